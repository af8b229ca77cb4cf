# EAGLE-3 draft training: chat data + verifier -> draft checkpoint that vLLM serves.
#   snakemake --cores all draft_ckpt     # build what is stale
#   snakemake -n draft_ckpt              # dry-run: what would run, and why


configfile: "config.yaml"


report: "report/workflow.rst"


include: "rules/common.smk"
include: "rules/demo.smk"
include: "rules/data.smk"
include: "rules/regenerate.smk"
include: "rules/prepare.smk"
include: "rules/vocab.smk"
include: "rules/extract.smk"
include: "rules/train.smk"
include: "rules/evaluate.smk"
include: "rules/export.smk"


rule all:
    """Default target: the draft checkpoint and its evaluation."""
    default_target: True
    input:
        rules.train.output.draft,
        rules.evaluate_draft.output,


rule vocab_map:
    """Target: the draft vocabulary map (and the tokenized data before it)."""
    input:
        rules.vocab.output,


rule hidden_states:
    """Target: the verifier's hidden states for all tokenized data (the extraction manifest)."""
    input:
        rules.extract_merge.output.manifest,


rule draft_ckpt:
    """Target: the trained EAGLE-3 draft (speculators format; vLLM serves it as eagle3)."""
    input:
        rules.train.output.draft,


rule evaluate:
    """Target: the draft evaluated under vLLM speculative decoding, and the config in force."""
    input:
        rules.evaluate_draft.output,
        rules.resolved_config.output,


rule export_sglang:
    """Target: the draft as SGLang serves it, in <results_dir>/export/sglang/."""
    input:
        L.export.draft("sglang"),


rule export_trtllm:
    """Target: the draft as TensorRT-LLM serves it, in <results_dir>/export/trtllm/."""
    input:
        L.export.draft("trtllm"),
