# EAGLE-3 draft training: chat data + verifier -> draft checkpoint that vLLM serves.
#   snakemake --cores all draft_ckpt     # build what is stale
#   snakemake -n draft_ckpt              # dry-run: what would run, and why


configfile: "config.yaml"


include: "rules/common.smk"
include: "rules/demo.smk"
include: "rules/prepare.smk"
include: "rules/vocab.smk"
include: "rules/extract.smk"
include: "rules/train.smk"


rule all:
    default_target: True
    input:
        rules.vocab.output,


rule vocab_map:
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
