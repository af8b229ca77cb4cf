"""extract: tokenized data + verifier -> hidden-state shards, and this job's part manifest.

Job ``job_index`` of ``extract.num_jobs`` computes its share of the shards (see
``lib/hidden_states/extraction.py`` for the plan, the fingerprints and the reuse of finished
shards).

Everything that can be checked is checked before the model loads, each failure naming the
config key to change: the verifier's config and weights, the layer ids, tensor parallel size
against heads and visible GPUs, sample lengths against the engine's max length, the token ids
against the vocabulary, free disk against the exact shard bytes (the disk plan, logged), writable
outputs.
"""

from __future__ import annotations

import logging

from workflow_scripts.lib.common import run_main
from workflow_scripts.lib.hidden_states.disk_plan import check_outputs
from workflow_scripts.lib.hidden_states.extract_engines import extract
from workflow_scripts.lib.hidden_states.extraction import make_plan, part_manifest, reuse_finished
from workflow_scripts.lib.verifier import engine
from workflow_scripts.lib.workflow import cli

log = logging.getLogger("eagle3")


def main() -> None:
    io, p = cli.parse("extract")
    plan = make_plan(io, p)
    reuse_finished(plan)
    todo = plan.todo
    log.info(
        "extract job %d/%d: %d samples in the data, %d shard(s) of %d for this job, %d finished "
        "already, %d to compute (%d samples, %d tokens); layers %s + final %d, computed in %s",
        io.job_index,
        p.num_jobs,
        plan.num_samples,
        len(plan.shards),
        p.shard_size_samples,
        len(plan.shards) - len(todo),
        len(todo),
        sum(len(s.samples) for s in todo),
        sum(s.num_tokens for s in todo),
        plan.aux_ids,
        plan.num_layers,
        f"{plan.dtype}, stored as {plan.storage}",
    )
    disk = check_outputs(io, p, plan)
    if todo:
        engine.check_devices(
            p, "extract", vllm=p.backend == "vllm", dtype=plan.dtype, verifier=io.verifier
        )
        extract(io, p, plan)
    else:
        log.info("nothing to compute: the model is not loaded")
    part = part_manifest(io, p, plan, disk)
    part.write(io.part)
    log.info(
        "extract job %d: %d shard(s), %d samples, %d tokens, %d skipped as too long -> %s",
        io.job_index,
        len(part.shards),
        part.num_samples,
        part.num_tokens,
        part.num_skipped_too_long,
        io.part,
    )


if __name__ == "__main__":
    run_main(main)
