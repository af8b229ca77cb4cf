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
    params:
        cli=stage_cli("demo", verifier=DEMO / "verifier"),
    log:
        LOGS / "demo.log",
    benchmark:
        BENCHMARKS / "demo.tsv"
    threads: workflow.cores
    conda:
        "../envs/workflow.yaml"
    shell:
        "python -m workflow_scripts.demo {params.cli} > {log} 2>&1"
