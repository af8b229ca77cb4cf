# Optional (regenerate.enabled): the verifier answers the user turns of chat_data itself, and
# prepare reads its answers. Finished batches go to REGENERATE_WORK, which is no rule's output:
# a killed job, started again, redoes only the batches it had not finished.
REGENERATE_WORK = RESULTS / "regenerate" / "batches"
REGENERATE_GPUS = CFG.regenerate.tensor_parallel_size if CFG.regenerate.use_gpus else 0


rule regenerate:
    """Chat data -> the same conversations with the verifier's own answers (vLLM)."""
    input:
        chat_data=CHAT_DATA,
        verifier_config=VERIFIER_CONFIG,
        weights=VERIFIER_WEIGHTS,
        code=stage_code("regenerate"),
    output:
        regenerated=REGENERATED_CHAT_DATA,
        stats=report(RESULTS / "regenerate" / "stats.json", category="Data"),
    log:
        LOGS / "regenerate.log",
    benchmark:
        BENCHMARKS / "regenerate.tsv"
    conda:
        "../envs/workflow.yaml"
    threads: 4 if CFG.regenerate.use_gpus else workflow.cores
    resources:
        gpu=REGENERATE_GPUS,
    params:
        config=stage_config("regenerate"),
        cmd=stage_cmd(
            "regenerate", gpus=REGENERATE_GPUS, verifier=VERIFIER_DIR, work_dir=REGENERATE_WORK
        ),
    shell:
        "{params.cmd} > {log} 2>&1"
