"""prepare: chat data (JSONL) -> tokenized_data.jsonl: every assistant turn supervised exactly
as the verifier generates it, with the chat template as it is served (``chat_template``).

Streams its input line by line (``chat.tokenization.tokenize_chat_file``), tokenized by
``num_processes`` worker processes (the rule's threads) in input order; writes one JSON object per
row, ``{"id", "input_ids", "loss_mask", "source_line"}`` (a conversation takes more than one row
where its template rewrites history), and a stats file (conversations and rows in and out,
supervised tokens by kind, extracted against unique tokens, drops by reason).
"""

from __future__ import annotations

import logging

from workflow_scripts.lib.chat.tokenization import prepare
from workflow_scripts.lib.common import run_main
from workflow_scripts.lib.workflow import cli

log = logging.getLogger("eagle3")


def main() -> None:
    io, p = cli.parse("prepare")
    stats = prepare(io, p)
    stats.write(io.stats)
    log.info("prepare: done: %s", stats.model_dump_json())


if __name__ == "__main__":
    run_main(main)
