rule vocab:
    """Tokenized data -> draft vocabulary map: d2t offsets, t2d mask, token counts."""
    input:
        tokenized=rules.prepare.output.tokenized,
        verifier_config=VERIFIER_CONFIG,
        code=stage_code("vocab"),
    output:
        vocab_map=L.vocab.vocab_map,
        stats=report(L.vocab.stats, category="Data"),
    log:
        L.logs / "vocab.log",
    conda:
        conda_env()
    params:
        config=stage_config("vocab"),
        made_from=made_from("vocab"),
        cmd=stage_cmd("vocab", verifier=VERIFIER_DIR),
    shell:
        "{params.cmd} > {log} 2>&1"
