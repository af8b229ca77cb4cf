# Draft training: the extraction manifest, the vocab map and the verifier's head -> the draft.
# The resume state (TRAIN / "state") is no rule's output: Snakemake never deletes it, so a killed
# or failed training job continues from its last checkpoint when run again (the script discards
# a state saved under other settings or inputs).
TRAIN = RESULTS / "train"
TRAIN_GPUS = CFG.train.num_gpus


rule train:
    """Hidden-state shards + vocab map + verifier head -> EAGLE-3 draft (speculators format)."""
    input:
        manifest=RESULTS / "extract" / "manifest.json",
        vocab_map=rules.vocab.output.vocab_map,
        verifier_config=VERIFIER_CONFIG,
        code=stage_code("train"),
    output:
        draft=directory(TRAIN / "draft"),
        metrics=TRAIN / "metrics.jsonl",
    log:
        LOGS / "train.log",
    benchmark:
        BENCHMARKS / "train.tsv"
    conda:
        "../envs/workflow.yaml"
    threads: workflow.cores
    resources:
        gpu=TRAIN_GPUS,
    params:
        config=stage_config("train"),
        cmd=stage_cmd("train", gpus=TRAIN_GPUS, verifier=VERIFIER_DIR, state_dir=TRAIN / "state"),
    shell:
        "{params.cmd} > {log} 2>&1"
