# The chat data's sources (config key chat_data: files, directories, globs, saved or hub
# datasets) -> one JSON Lines file, mixed by each source's rows or weight. The source files are
# inputs (a changed file reruns it); a hub dataset is pinned to a commit in its params.
rule data:
    """The chat data's sources -> one file of conversations, each naming its source and row."""
    input:
        sources=DATA_FILES,
        code=stage_code("data"),
    output:
        mixture=L.data.chat_data,
        stats=report(L.data.stats, category="Data"),
    log:
        L.logs / "data.log",
    benchmark:
        L.benchmarks / "data.tsv"
    conda:
        conda_env()
    params:
        config=stage_config("data"),
        made_from=made_from("data"),
        cmd=stage_cmd("data"),
    shell:
        "{params.cmd} > {log} 2>&1"
