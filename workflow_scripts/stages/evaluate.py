"""evaluate: the trained draft under real vLLM speculative decoding, against no draft and n-gram.

For the held-out prompts (chat template applied) it serves the verifier in vLLM with the EAGLE-3
draft, greedy, and optionally also at a sampled temperature, and holds it to the verifier served
without speculation and with vLLM's n-gram (prompt lookup) speculator, which the
evaluate_reference stage served on the same prompts (stages/evaluate_reference.py). From vLLM's own
counters it records mean acceptance length and the acceptance rate per draft position, and from
its per-request metrics a 95% bootstrap interval over prompts for each; beside them, what training
simulated for the draft on its held-out split. From wall-clock around ``generate`` the output
tokens/s. Greedy outputs with a speculator must equal the outputs without: every mismatch is
listed. Writes a JSON file (lib/evaluation/records.py) and PNG plots; the work is
lib/evaluation/run.py's.
"""

from __future__ import annotations

import logging

from workflow_scripts.lib.common import atomic_path, run_main
from workflow_scripts.lib.evaluation.plots import plot
from workflow_scripts.lib.evaluation.run import evaluate
from workflow_scripts.lib.workflow import cli

log = logging.getLogger("eagle3")


def main() -> None:
    io, p = cli.parse("evaluate")
    results = evaluate(io, p)
    with atomic_path(io.plot_dir) as tmp_dir:
        plot(results.model_dump(mode="json", exclude_unset=True), io.metrics, tmp_dir)
    results.write(io.results)
    log.info("evaluate: %s", results.summary.model_dump_json())


if __name__ == "__main__":
    run_main(main)
