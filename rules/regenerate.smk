# Optional (regenerate.enabled): the verifier answers the user turns of chat_data itself, and
# prepare reads its answers. regenerate.num_jobs data-parallel jobs, each one model load and the
# batches b with b % num_jobs == job_index, then one merge. Batches go to L.regenerate.batches, which
# is no rule's output: a killed job, started again, redoes only the batches it had not finished.
REGENERATE_GPUS = CFG.regenerate.gpus  # on all the job's nodes together
REGENERATE_NODES = CFG.regenerate.num_nodes


rule regenerate:
    """Chat data -> the verifier's answers (vLLM) for the batches of job {job_index}."""
    input:
        chat_data=L.data.chat_data,
        verifier_config=VERIFIER_CONFIG,
        weights=VERIFIER_WEIGHTS,
        code=stage_code("regenerate"),
    output:
        part=L.regenerate.part("{job_index}"),
    log:
        L.logs / "regenerate" / "job_{job_index}.log",
    benchmark:
        L.benchmarks / "regenerate" / "job_{job_index}.tsv"
    wildcard_constraints:
        job_index=r"\d+",
    conda:
        conda_env(REGENERATE_GPUS)
    threads: 4 if CFG.regenerate.use_gpus else workflow.cores
    resources:
        **node_resources(REGENERATE_NODES, CFG.regenerate.gpus_per_node),
        gpu=REGENERATE_GPUS,
    params:
        config=stage_config("regenerate", job_layout=True),
        made_from=made_from("regenerate"),
        cmd=stage_cmd(
            "regenerate",
            gpus=CFG.regenerate.gpus_per_node,
            nodes=REGENERATE_NODES,
            engine=True,
            verifier=VERIFIER_DIR,
            work_dir=L.regenerate.batches,
        ),
    shell:
        "{params.cmd} > {log} 2>&1"


# A checkpoint, as extract_merge: prepare reruns only if the merged chat data changed.
checkpoint regenerate_merge:
    """The jobs' batches -> one chat dataset with the verifier's answers, and its statistics."""
    input:
        parts=expand(
            L.regenerate.part("{job_index}"),
            job_index=range(CFG.regenerate.num_jobs),
        ),
        code=stage_code("regenerate_merge"),
    output:
        regenerated=L.regenerate.chat_data,
        stats=report(L.regenerate.stats, category="Data"),
    log:
        L.logs / "regenerate_merge.log",
    conda:
        conda_env()
    params:
        # regenerate's settings too (as extract_merge's: a failed job's part is run again)
        config=stage_config("regenerate", job_layout=True),
        made_from=made_from("regenerate_merge"),
        cmd=stage_cmd("regenerate_merge", work_dir=L.regenerate.batches),
    shell:
        "{params.cmd} > {log} 2>&1"
