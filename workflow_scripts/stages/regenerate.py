"""regenerate: the verifier answers the user turns of the chat data itself (self-distillation).

Job ``job_index`` of ``regenerate.num_jobs`` answers its share of the batches with real vLLM
(``lib/regeneration/run.py``; ``lib/regeneration/answers.py`` has how answers are written, resumed
and fingerprinted) and writes its part.
"""

from __future__ import annotations

import logging

from workflow_scripts.lib.common import run_main
from workflow_scripts.lib.regeneration.run import regenerate
from workflow_scripts.lib.workflow import cli

log = logging.getLogger("eagle3")


def main() -> None:
    io, p = cli.parse("regenerate")
    part = regenerate(io, p)
    part.write(io.part)
    log.info("regenerate job %d: %d batches -> %s", io.job_index, len(part.batches), io.part)


if __name__ == "__main__":
    run_main(main)
