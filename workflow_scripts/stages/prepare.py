"""prepare: chat data (JSONL) -> tokenized_data.jsonl with an assistant-only loss mask.

Streams its input line by line (``chat.tokenize_chat_file``); writes one JSON object per kept
conversation: ``{"id", "input_ids", "loss_mask"}``, and a stats file (rows in/out, tokens, drops
by reason).
"""

from __future__ import annotations

import json
import logging

from workflow_scripts.lib import cli
from workflow_scripts.lib.chat import tokenize_chat_file
from workflow_scripts.lib.common import (
    Progress,
    UserError,
    atomic_path,
    run_main,
    write_json,
)
from workflow_scripts.lib.verifier import load_tokenizer

log = logging.getLogger("eagle3")


def main() -> None:
    io, p = cli.parse("prepare")
    if not io.chat_data.is_file():
        raise UserError(f"chat data '{io.chat_data}' does not exist (config key 'chat_data')")
    tokenizer = load_tokenizer(io.verifier)
    log.info("prepare: %s with the chat template of %s", io.chat_data, io.verifier)

    progress = Progress("prepare", total=None, interval_s=p.progress_interval_s)
    with atomic_path(io.tokenized) as tmp, open(tmp, "w", encoding="utf-8") as out:
        counts = tokenize_chat_file(
            io.chat_data, tokenizer, p.max_seq_len_tokens, p.on_bad_row, out, progress
        )
        if counts["rows_out"] == 0:
            raise UserError(
                f"{io.chat_data}: no usable conversation among {counts['rows_in']} rows "
                f"(dropped: {counts['dropped'] or 'none'})"
            )
    progress.log()
    stats = {
        "chat_data": str(io.chat_data),
        "verifier": str(io.verifier),
        **{k: v for k, v in counts.items() if k != "dropped"},
        "max_seq_len_tokens": p.max_seq_len_tokens,
        "dropped": counts["dropped"],
    }
    write_json(io.stats, stats)
    log.info("prepare: done: %s", json.dumps(stats))


if __name__ == "__main__":
    run_main(main)
