"""prepare: chat data (JSONL) -> tokenized_data.jsonl: every assistant turn supervised exactly
as the verifier generates it, with the chat template as it is served (``chat_template``).

Streams its input line by line (``chat.dataset.tokenize_chat_file``), tokenized by
``num_processes`` worker processes (the rule's threads) in input order; writes one JSON object per
row, ``{"id", "input_ids", "loss_mask", "source_line"}`` (a conversation takes more than one row
where its template rewrites history), and a stats file (conversations and rows in and out,
supervised tokens by kind, extracted against unique tokens, drops by reason).
"""

from __future__ import annotations

import json
import logging
import os
from functools import partial

from workflow_scripts.lib.chat.dataset import tokenize_chat_file
from workflow_scripts.lib.chat.template import load_template
from workflow_scripts.lib.common import (
    Progress,
    UserError,
    atomic_path,
    run_main,
)
from workflow_scripts.lib.workflow import cli
from workflow_scripts.lib.workflow.code_inputs import made_by
from workflow_scripts.lib.workflow.records import PrepareStats

log = logging.getLogger("eagle3")


def main() -> None:
    io, p = cli.parse("prepare")
    if not io.chat_data.is_file():
        raise UserError(f"chat data '{io.chat_data}' does not exist (config key 'chat_data')")
    template = load_template(io.verifier, p.chat_template)  # checked here, before any worker
    cpus = len(os.sched_getaffinity(0))
    processes = min(p.num_processes or cpus, cpus)
    log.info(
        "prepare: %s with the chat template of %s, arguments %s, date %s; %d processes",
        io.chat_data,
        io.verifier,
        json.dumps(p.chat_template.kwargs),
        p.chat_template.date,
        processes,
    )

    progress = Progress("prepare", total=None, interval_s=p.progress_interval_s)
    with atomic_path(io.tokenized) as tmp, open(tmp, "w", encoding="utf-8") as out:
        counts = tokenize_chat_file(
            io.chat_data,
            template,
            p.max_seq_len_tokens,
            p.on_bad_row,
            out,
            progress,
            processes=processes,
            load=partial(load_template, io.verifier, p.chat_template),
        )
        if counts["rows_out"] == 0:
            raise UserError(
                f"{io.chat_data}: no usable conversation among {counts['rows_in']} rows "
                f"(dropped: {counts['dropped'] or 'none'}): no supervised token came out of the "
                f"chat template of {io.verifier} with chat_template {p.chat_template.model_dump()}"
            )
    progress.log()
    stats = PrepareStats(
        chat_data=str(io.chat_data),
        verifier=str(io.verifier),
        **counts,
        max_seq_len_tokens=p.max_seq_len_tokens,
        chat_template=p.chat_template.model_dump(),
        made_by=made_by("prepare"),
    )
    stats.write(io.stats)
    log.info("prepare: done: %s", stats.model_dump_json())


if __name__ == "__main__":
    run_main(main)
