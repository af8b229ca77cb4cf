EVALUATE_GPUS = CFG.evaluate.gpus  # on all the job's nodes together
EVALUATE_NODES = CFG.evaluate.num_nodes


rule evaluate_reference:
    """The verifier under vLLM without a draft and with n-gram on the held-out prompts: served once
    for the prompts and settings, whatever draft is trained after."""
    input:
        verifier_config=VERIFIER_CONFIG,
        eval_prompts=EVAL_FILES,
        code=stage_code("evaluate_reference"),
    output:
        reference=L.evaluate.reference,
    log:
        L.logs / "evaluate_reference.log",
    benchmark:
        L.benchmarks / "evaluate_reference.tsv"
    conda:
        conda_env(EVALUATE_GPUS)
    threads: workflow.cores
    resources:
        **node_resources(EVALUATE_NODES, CFG.evaluate.gpus_per_node),
        gpu=EVALUATE_GPUS,
    params:
        config=stage_config("evaluate_reference"),
        made_from=made_from("evaluate_reference"),
        cmd=stage_cmd(
            "evaluate_reference",
            gpus=CFG.evaluate.gpus_per_node,
            nodes=EVALUATE_NODES,
            engine=True,
            verifier=VERIFIER_DIR,
        ),
    shell:
        "{params.cmd} > {log} 2>&1"


rule evaluate_draft:
    """The draft under real vLLM speculative decoding: acceptance, throughput, held to the
    verifier alone and n-gram (rule evaluate_reference)."""
    input:
        verifier_config=VERIFIER_CONFIG,
        draft=rules.train.output.draft,
        reference=rules.evaluate_reference.output.reference,
        eval_prompts=EVAL_FILES,
        metrics=rules.train.output.metrics,
        code=stage_code("evaluate"),
    output:
        results=report(
            L.evaluate.results,
            category="Evaluation",
            caption="../report/evaluation.rst",
        ),
        plot_dir=report(
            directory(L.evaluate.plots),
            patterns=["{name}.png"],
            category="Evaluation",
            caption="../report/plots.rst",
        ),
    log:
        L.logs / "evaluate.log",
    benchmark:
        L.benchmarks / "evaluate.tsv"
    conda:
        conda_env(EVALUATE_GPUS)
    threads: workflow.cores
    resources:
        **node_resources(EVALUATE_NODES, CFG.evaluate.gpus_per_node),
        gpu=EVALUATE_GPUS,
    params:
        config=stage_config("evaluate"),
        made_from=made_from("evaluate_draft"),
        cmd=stage_cmd(
            "evaluate",
            gpus=CFG.evaluate.gpus_per_node,
            nodes=EVALUATE_NODES,
            engine=True,
            verifier=VERIFIER_DIR,
        ),
    shell:
        "{params.cmd} > {log} 2>&1"


# the settings that decide the results (lib/dryrun.py: resolved_config)
RESOLVED = dryrun.resolved_config(CFG, VERIFIER_CFG)


rule resolved_config:
    """The settings that decided the results, every default filled in (for the report and the
    record); execution settings are left out: they change how jobs run, not what they make."""
    output:
        report(L.resolved_config, category="Configuration"),
    log:
        L.logs / "resolved_config.log",
    conda:
        conda_env()
    params:
        config=json.dumps(RESOLVED, sort_keys=True),
    run:
        Path(output[0]).write_text(yaml.safe_dump(RESOLVED, sort_keys=False))
