rule demo:
    """The embedded default: generated chat data and a tiny trained Llama verifier."""
    input:
        code=stage_code("demo"),
    output:
        chat_data=L.demo.chat_data,
        eval_prompts=L.demo.eval_prompts,
        config=L.demo.verifier / "config.json",
        weights=L.demo.verifier / "model.safetensors",
        tokenizer=L.demo.verifier / "tokenizer.json",
    log:
        L.logs / "demo.log",
    benchmark:
        L.benchmarks / "demo.tsv"
    conda:
        conda_env()
    threads: workflow.cores
    params:
        config=stage_config("demo"),
        cmd=stage_cmd("demo", verifier=L.demo.verifier),
    shell:
        "{params.cmd} > {log} 2>&1"
