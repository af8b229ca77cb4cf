"""extract_plan: tokenized data + verifier -> every shard's samples, lengths, exact bytes and
fingerprint, without computing any (with ``extract.disk_budget``: what training plans its budget
from, and the dry-run shows the costs from, see ``lib/training/stream_consumer.py``).

The same checks as an extraction job makes before its model loads (``make_plan``): the
verifier's config and weights, the layer ids, sample lengths, token ids.
"""

from __future__ import annotations

import logging

from workflow_scripts.lib.common import run_main
from workflow_scripts.lib.hidden_states.stream_producer import all_shards_plan, stream_plan
from workflow_scripts.lib.workflow import cli

log = logging.getLogger("eagle3")


def main() -> None:
    io, p = cli.parse("extract_plan")
    plan = all_shards_plan(io.tokenized, io.verifier, io.shard_dir, p)
    out = stream_plan(plan, io.shard_dir)
    out.write(io.plan)
    log.info(
        "stream plan: %d shard(s), %d samples, %d tokens, %.3f GiB of hidden states in %s "
        "(%d skipped as too long) -> %s",
        len(out.shards),
        out.num_samples,
        out.num_tokens,
        out.bytes / 2**30,
        plan.storage,
        out.num_skipped_too_long,
        io.plan,
    )


if __name__ == "__main__":
    run_main(main)
