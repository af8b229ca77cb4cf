"""evaluate_reference: the held-out prompts served by the verifier in vLLM without a draft and with
vLLM's n-gram (prompt lookup) speculator, each engine in its own process, greedy (and optionally
at a sampled temperature), then timed at each concurrency: what the evaluate stage holds every
draft to. Nothing here depends on the draft, so its rule serves them once for the prompts and the
evaluate settings, and a draft trained again is served alone. Writes a JSON file
(lib/evaluation/records.py: ``References``); the work is lib/evaluation/run.py's.
"""

from __future__ import annotations

import logging

from workflow_scripts.lib.common import run_main
from workflow_scripts.lib.evaluation.run import reference
from workflow_scripts.lib.workflow import cli

log = logging.getLogger("eagle3")


def main() -> None:
    io, p = cli.parse("evaluate_reference")
    refs = reference(io, p)
    refs.write(io.reference)
    log.info(
        "evaluate_reference: %s",
        ", ".join(
            f"{k} {r.output_tokens} tokens in {r.generation_s:.0f} s" for k, r in refs.runs.items()
        ),
    )


if __name__ == "__main__":
    run_main(main)
