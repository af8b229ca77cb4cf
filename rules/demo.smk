rule demo:
    """The embedded default: generated chat data and a tiny trained Llama verifier."""
    input:
        code=stage_code("demo"),
    output:
        chat_data=DEMO / "chat_data.jsonl",
        eval_prompts=DEMO / "eval_prompts.jsonl",
        config=DEMO / "verifier" / "config.json",
        weights=DEMO / "verifier" / "model.safetensors",
        tokenizer=DEMO / "verifier" / "tokenizer.json",
    log:
        LOGS / "demo.log",
    benchmark:
        BENCHMARKS / "demo.tsv"
    conda:
        conda_env()
    threads: workflow.cores
    params:
        config=stage_config("demo"),
        cmd=stage_cmd("demo", verifier=DEMO / "verifier"),
    shell:
        "{params.cmd} > {log} 2>&1"
