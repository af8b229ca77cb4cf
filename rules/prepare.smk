rule prepare:
    """Chat data -> tokenized_data.jsonl (chat template applied, assistant-only loss mask)."""
    input:
        chat_data=PREPARE_CHAT_DATA,
        verifier_config=VERIFIER_CONFIG,
        code=stage_code("prepare"),
    output:
        tokenized=L.prepare.tokenized,
        stats=report(L.prepare.stats, category="Data"),
    log:
        L.logs / "prepare.log",
    conda:
        conda_env()
    threads: CFG.prepare.num_processes or workflow.cores
    params:
        config=stage_config("prepare"),
        made_from=made_from("prepare"),
        cmd=stage_cmd("prepare", threads_as="num_processes", verifier=VERIFIER_DIR),
    shell:
        "{params.cmd} > {log} 2>&1"
