# Draft training: the extraction manifest, the vocab map and the verifier's head -> the draft.
# The resume state (L.train.state) is no rule's output: Snakemake never deletes it, so a killed
# or failed training job continues from its last checkpoint when run again (the script discards
# a state saved under other settings or inputs).
#
# With extract.disk_budget, training does not wait for the extract jobs: it takes the stream plan
# (every shard's samples and exact bytes, rule extract_plan) and runs the engine itself
# (extract_stream, on GPUs of its own beside training's, or on training's with
# extract.share_training_gpus: the job reserves both), which computes each shard shortly before
# a step reads it, into L.extract.stream_shards, within the budget (lib/training/stream_consumer.py).
STREAMED = CFG.extract.disk_budget is not None
TRAIN_GPUS = CFG.train.job_gpus(CFG.extract)
# Over several nodes (train.num_nodes): one SLURM job of whole nodes, TRAIN_GPUS on each
# (lib/workflow/nodes.py: node_resources), started on every node by the nodes launcher.
NODES = CFG.train.num_nodes
ENGINE_CMD = (
    command_now(
        "extract_stream",
        tokenized=rules.prepare.output.tokenized,
        verifier=VERIFIER_DIR,
        shard_dir=L.extract.stream_shards,
    )
    if STREAMED
    else ""
)


rule extract_plan:
    """Tokenized data + verifier -> every shard's samples, exact bytes and fingerprint (a disk budget's plan)."""
    input:
        tokenized=rules.prepare.output.tokenized,
        verifier_config=VERIFIER_CONFIG,
        weights=VERIFIER_WEIGHTS,
        code=stage_code("extract_plan"),
    output:
        plan=L.extract.stream_plan,
    log:
        L.logs / "extract_plan.log",
    conda:
        conda_env()
    params:
        config=stage_config("extract_plan"),
        made_from=made_from("extract_plan"),
        cmd=stage_cmd("extract_plan", verifier=VERIFIER_DIR, shard_dir=L.extract.stream_shards),
    shell:
        "{params.cmd} > {log} 2>&1"


rule train:
    """Hidden-state shards (or, with a disk budget, the engine run alongside) + vocab map + verifier head -> EAGLE-3 draft (speculators format)."""
    input:
        manifest=L.extract.stream_plan if STREAMED else L.extract.manifest,
        vocab_map=rules.vocab.output.vocab_map,
        verifier_config=VERIFIER_CONFIG,
        engine=[rules.prepare.output.tokenized, *VERIFIER_WEIGHTS] if STREAMED else [],
        code=[stage_code("train")] + ([stage_code("extract_stream")] if STREAMED else []),
        init_from=INIT_FROM_FILES,
    output:
        draft=directory(L.train.draft),
        metrics=L.train.metrics,
    log:
        L.logs / "train.log",
    benchmark:
        L.benchmarks / "train.tsv"
    conda:
        conda_env(TRAIN_GPUS)
    threads: workflow.cores
    resources:
        **node_resources(NODES, TRAIN_GPUS),
        gpu=TRAIN_GPUS * NODES,
    params:
        config=stage_config("train"),
        engine=stage_config("extract") if STREAMED else "",
        made_from=made_from("train"),
        cmd=stage_cmd(
            "train",
            gpus=TRAIN_GPUS,
            nodes=NODES,
            verifier=VERIFIER_DIR,
            state_dir=L.train.state,
            engine_cmd=ENGINE_CMD,
        ),
    shell:
        "{params.cmd} > {log} 2>&1"
