# Hidden-state extraction: extract.num_jobs data-parallel jobs, each one model load and the shards
# i with i % num_jobs == job_index, then one manifest. Shards go to L.extract.shards, which is no
# rule's output: Snakemake never deletes a finished shard, and a rerun job reuses every shard
# whose fingerprint still matches (a killed job redoes only the shards it had not finished).
EXTRACT_GPUS = CFG.extract.gpus  # on all the job's nodes together
EXTRACT_NODES = CFG.extract.num_nodes


rule extract:
    """Tokenized data + verifier -> hidden-state shards of job {job_index}, and its part manifest."""
    input:
        tokenized=rules.prepare.output.tokenized,
        verifier_config=VERIFIER_CONFIG,
        weights=VERIFIER_WEIGHTS,
        code=stage_code("extract"),
    output:
        part=L.extract.part("{job_index}"),
    log:
        L.logs / "extract" / "job_{job_index}.log",
    benchmark:
        L.benchmarks / "extract" / "job_{job_index}.tsv"
    wildcard_constraints:
        job_index=r"\d+",
    conda:
        conda_env(EXTRACT_GPUS)
    threads: 4 if CFG.extract.use_gpus else workflow.cores
    resources:
        **node_resources(EXTRACT_NODES, CFG.extract.gpus_per_node),
        gpu=EXTRACT_GPUS,
    params:
        config=stage_config("extract", job_layout=True),
        made_from=made_from("extract"),
        cmd=stage_cmd(
            "extract",
            gpus=CFG.extract.gpus_per_node,
            nodes=EXTRACT_NODES,
            engine=True,
            verifier=VERIFIER_DIR,
            shard_dir=L.extract.shards,
        ),
    shell:
        "{params.cmd} > {log} 2>&1"


# A checkpoint: once it has run, Snakemake looks again at what follows, and reruns training only
# if the manifest changed (a change of extract.num_jobs reruns the jobs, which load no model,
# and this merge, which writes the same manifest).
checkpoint extract_merge:
    """The jobs' part manifests -> the manifest of all shards (what training depends on)."""
    input:
        parts=expand(
            L.extract.part("{job_index}"),
            job_index=range(CFG.extract.num_jobs),
        ),
        code=stage_code("extract_merge"),
    output:
        manifest=report(L.extract.manifest, category="Extraction"),
    log:
        L.logs / "extract_merge.log",
    conda:
        conda_env()
    params:
        # extract's settings too: after a failed extract job (its part removed), a rerun merges
        # again, and so runs the job again, instead of keeping the manifest of the old settings
        config=stage_config("extract", job_layout=True),
        made_from=made_from("extract_merge"),
        cmd=stage_cmd("extract_merge"),
    shell:
        "{params.cmd} > {log} 2>&1"
