# Hidden-state extraction: extract.num_jobs data-parallel jobs, each one model load and the shards
# i with i % num_jobs == job_index, then one manifest. Shards go to EXTRACT_SHARDS, which is no
# rule's output: Snakemake never deletes a finished shard, and a rerun job reuses every shard
# whose fingerprint still matches (a killed job redoes only the shards it had not finished).
EXTRACT = RESULTS / "extract"
EXTRACT_SHARDS = EXTRACT / "shards"
EXTRACT_GPUS = CFG.extract.gpus


rule extract:
    """Tokenized data + verifier -> hidden-state shards of job {job_index}, and its part manifest."""
    input:
        tokenized=rules.prepare.output.tokenized,
        verifier_config=VERIFIER_CONFIG,
        weights=VERIFIER_WEIGHTS,
        code=stage_code("extract"),
    output:
        part=EXTRACT / "parts" / "part_{job_index}.json",
    log:
        LOGS / "extract" / "job_{job_index}.log",
    benchmark:
        BENCHMARKS / "extract" / "job_{job_index}.tsv"
    wildcard_constraints:
        job_index=r"\d+",
    conda:
        conda_env(EXTRACT_GPUS)
    threads: 4 if CFG.extract.use_gpus else workflow.cores
    resources:
        gpu=EXTRACT_GPUS,
    params:
        config=stage_config("extract", job_layout=True),
        cmd=stage_cmd("extract", gpus=EXTRACT_GPUS, verifier=VERIFIER_DIR, shard_dir=EXTRACT_SHARDS),
    shell:
        "{params.cmd} > {log} 2>&1"


# A checkpoint: once it has run, Snakemake looks again at what follows, and reruns training only
# if the manifest changed (a change of extract.num_jobs reruns the jobs, which load no model,
# and this merge, which writes the same manifest).
checkpoint extract_merge:
    """The jobs' part manifests -> the manifest of all shards (what training depends on)."""
    input:
        parts=expand(
            EXTRACT / "parts" / "part_{job_index}.json",
            job_index=range(CFG.extract.num_jobs),
        ),
        code=stage_code("extract_merge"),
    output:
        manifest=report(EXTRACT / "manifest.json", category="Extraction"),
    log:
        LOGS / "extract_merge.log",
    conda:
        conda_env()
    params:
        cmd=stage_cmd("extract_merge"),
    shell:
        "{params.cmd} > {log} 2>&1"
