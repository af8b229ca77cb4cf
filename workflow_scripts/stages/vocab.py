"""vocab: tokenized data -> the draft vocabulary map (d2t / t2d; see ``lib/draft/vocab_map.py``)."""

from __future__ import annotations

import json
import logging

from workflow_scripts.lib.common import UserError, run_main, write_json
from workflow_scripts.lib.draft.vocab_map import count_masked_tokens, write_vocab_map
from workflow_scripts.lib.verifier.files import verifier_config
from workflow_scripts.lib.workflow import cli
from workflow_scripts.lib.workflow.code_inputs import made_by

log = logging.getLogger("eagle3")


def main() -> None:
    io, p = cli.parse("vocab")
    vocab_size = int(verifier_config(io.verifier)["vocab_size"])
    k = p.draft_vocab_size
    if k > vocab_size:
        log.warning(
            "vocab.draft_vocab_size %d exceeds the verifier's vocabulary (%d): using %d",
            k,
            vocab_size,
            vocab_size,
        )
        k = vocab_size
    counts, rows = count_masked_tokens(io.tokenized, vocab_size)
    if rows == 0:
        raise UserError(f"{io.tokenized} is empty: nothing to count")
    coverage = write_vocab_map(io.vocab_map, counts, k)
    stats = {
        "rows": rows,
        "verifier_vocab_size": vocab_size,
        "draft_vocab_size": k,
        "requested_draft_vocab_size": p.draft_vocab_size,
        "loss_masked_tokens": coverage["loss_masked_tokens"],
        "distinct_loss_masked_tokens": coverage["distinct_loss_masked_tokens"],
        "coverage": coverage["coverage"],
        "made_by": made_by("vocab"),
    }
    write_json(io.stats, stats)
    log.info("vocab: done: %s", json.dumps(stats))


if __name__ == "__main__":
    run_main(main)
