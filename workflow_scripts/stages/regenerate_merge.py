"""regenerate_merge: the regenerate jobs' batches -> one chat dataset, in input order, and stats.

``regeneration.merge.merge`` checks that the parts come from one run (same input, batch keys,
batch count and job count), that every batch is some job's exactly once, and that every batch
file is there with its key. The batch files stay where they are: they are what this step reads,
and a restarted regenerate job reuses them.
"""

from __future__ import annotations

import logging

from workflow_scripts.lib.common import run_main
from workflow_scripts.lib.regeneration.merge import merge
from workflow_scripts.lib.workflow import cli

log = logging.getLogger("eagle3")


def main() -> None:
    io, _ = cli.parse("regenerate_merge")
    stats = merge(io)
    stats.write(io.stats)
    log.info("regenerate_merge: %s", stats.model_dump_json(exclude={"params", "made_by"}))


if __name__ == "__main__":
    run_main(main)
