rule export:
    """The trained draft -> the layout {engine} serves (SGLang or TensorRT-LLM), with serve.sh."""
    input:
        draft=rules.train.output.draft,
        code=stage_code("export"),
    output:
        export=directory(L.export.draft("{engine}")),
    log:
        L.logs / "export_{engine}.log",
    wildcard_constraints:
        engine="sglang|trtllm",
    conda:
        conda_env()
    params:
        made_from=made_from("export"),
        cmd=stage_cmd("export"),
    shell:
        "{params.cmd} > {log} 2>&1"
