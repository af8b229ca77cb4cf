"""prepare: chat data (JSONL) -> tokenized_data.jsonl with an assistant-only loss mask.

Streams its input line by line; writes one JSON object per kept conversation:
``{"id", "input_ids", "loss_mask"}``, and a stats file (rows in/out, tokens, drops by reason).
"""

from __future__ import annotations

import json
import logging
from collections import Counter

from workflow_scripts import cli
from workflow_scripts.chat import (
    BadRow,
    has_chat_template,
    normalize,
    skip_or_fail,
    tokenize_conversation,
)
from workflow_scripts.common import Progress, UserError, atomic_path, run_main, write_json

log = logging.getLogger("eagle3")


def load_tokenizer(verifier):
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(verifier))
    except Exception as exc:  # transformers raises many kinds; all mean the same to the user
        raise UserError(f"cannot load the tokenizer of verifier '{verifier}': {exc}") from None
    if not has_chat_template(tokenizer):
        raise UserError(
            f"the tokenizer of verifier '{verifier}' has no chat template; add 'chat_template' "
            "to its tokenizer_config.json (or a chat_template.jinja file beside it)"
        )
    if not tokenizer.is_fast:
        raise UserError(f"verifier '{verifier}': a fast tokenizer (tokenizer.json) is required")
    return tokenizer


def main() -> None:
    io, p = cli.parse("prepare")
    if not io.chat_data.is_file():
        raise UserError(f"chat data '{io.chat_data}' does not exist (config key 'chat_data')")
    tokenizer = load_tokenizer(io.verifier)
    log.info("prepare: %s with the chat template of %s", io.chat_data, io.verifier)

    drops: Counter[str] = Counter()
    rows_in = rows_out = tokens = masked = truncated = 0
    progress = Progress("prepare", total=None, interval_s=p.progress_interval_s)
    with atomic_path(io.tokenized) as tmp, open(io.chat_data, encoding="utf-8") as src, open(
        tmp, "w", encoding="utf-8"
    ) as dst:
        for line_no, line in enumerate(src, start=1):
            if not line.strip():
                continue
            rows_in += 1
            try:
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise BadRow("malformed", f"not valid JSON ({exc.msg})") from None
                sample = tokenize_conversation(tokenizer, normalize(row), p.max_seq_len_tokens)
                if not any(sample.loss_mask):
                    raise BadRow(
                        "no_assistant_tokens",
                        "no assistant tokens"
                        + (" left after truncation" if sample.truncated else ""),
                    )
            except BadRow as bad:
                # rows left without assistant tokens are always dropped and counted
                policy = "skip" if bad.reason == "no_assistant_tokens" else p.on_bad_row
                skip_or_fail(drops, bad, f"{io.chat_data}:{line_no}", policy, "prepare.on_bad_row")
                progress.update(1)
                continue
            row_id = row.get("id", f"line{line_no}")
            dst.write(
                json.dumps(
                    {"id": row_id, "input_ids": sample.input_ids, "loss_mask": sample.loss_mask},
                    separators=(",", ":"),
                )
                + "\n"
            )
            rows_out += 1
            tokens += len(sample.input_ids)
            masked += sum(sample.loss_mask)
            truncated += sample.truncated
            progress.update(1, len(sample.input_ids))
        if rows_out == 0:
            raise UserError(
                f"{io.chat_data}: no usable conversation among {rows_in} rows "
                f"(dropped: {dict(drops) or 'none'})"
            )
    progress.log()
    stats = {
        "chat_data": str(io.chat_data),
        "verifier": str(io.verifier),
        "rows_in": rows_in,
        "rows_out": rows_out,
        "tokens": tokens,
        "loss_masked_tokens": masked,
        "truncated_rows": truncated,
        "max_seq_len_tokens": p.max_seq_len_tokens,
        "dropped": dict(sorted(drops.items())),
    }
    write_json(io.stats, stats)
    log.info("prepare: done: %s", json.dumps(stats))


if __name__ == "__main__":
    run_main(main)
