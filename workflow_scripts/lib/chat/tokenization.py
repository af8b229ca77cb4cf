"""A chat data file tokenized for training (prepare's output): each conversation's turns
(``turns.py``) in the fewest rows, streamed; bad conversations fail or are counted; the cost of
exactness kept visible in the statistics (rows per conversation, supervised tokens by kind,
extracted tokens against the tokens the rows would hold with their shared prefixes once); and the
prepare stage's work (``prepare``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing
import os
from collections import Counter, deque
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import IO, Any, Callable, Iterator

from workflow_scripts.lib.chat.rows import (
    SOURCE,
    BadRow,
    Conversation,
    normalize,
    origin,
    parse_line,
    read_lines,
    skip_or_fail,
)
from workflow_scripts.lib.chat.template import ChatTemplate, load_template
from workflow_scripts.lib.chat.turns import KINDS, Row, conversation_turns, pack_rows, unique_tokens
from workflow_scripts.lib.common import Progress, UserError, atomic_path
from workflow_scripts.lib.workflow.code_inputs import made_by
from workflow_scripts.lib.workflow.definitions import PrepareParams
from workflow_scripts.lib.workflow.records import PrepareStats
from workflow_scripts.lib.workflow.registry import PrepareIO

log = logging.getLogger("eagle3")

SETTING = "prepare.on_bad_row"
RECORDED = "regenerated_ids"  # on an assistant message: the ids regenerate served and sampled


@dataclass
class Tokenized:
    input_ids: list[int]
    loss_mask: list[int]
    truncated: bool


def read_conversation(row: Any) -> Conversation:
    """A parsed row as a Conversation, with the ids recorded by regeneration, if any."""
    conv = normalize(row)
    raw = row.get("messages") if isinstance(row, dict) else None
    for i, msg in enumerate(raw or []):
        ids = msg.get(RECORDED) if isinstance(msg, dict) else None
        if isinstance(ids, dict) and conv.messages[i]["role"] == "assistant":
            prompt, generated = ids.get("prompt"), ids.get("generated")
            if not (_ids(prompt) and _ids(generated)):
                raise BadRow("malformed", f"message {i} {RECORDED} are not lists of token ids")
            conv.extra.setdefault("turn_ids", {})[i] = (prompt, generated)
    return conv


def _ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, int) for v in value)


def tokenize_rows(ct: ChatTemplate, conv: Conversation, max_len: int) -> tuple[list[Row], Counter]:
    """The rows of a conversation (cut to ``max_len`` tokens) and its supervised tokens by kind;
    a BadRow if no row keeps a supervised token."""
    turns = conversation_turns(ct, conv)
    if not turns:
        raise BadRow("no_assistant_tokens", "no assistant turn")
    kinds: Counter = Counter()
    for turn in turns:
        kinds.update(turn.kinds)
    rows = pack_rows(turns)
    if not any(1 in r.loss_mask[:max_len] for r in rows):
        raise BadRow("no_assistant_tokens", "no assistant tokens left after truncation")
    return rows, kinds


def tokenize_conversation(tokenizer, messages: list[dict], max_len: int) -> Tokenized:
    """One conversation of plain messages as one row (its template renders history stably,
    as the demo's does): input ids and loss mask, cut to ``max_len``."""
    rows, _ = tokenize_rows(ChatTemplate(tokenizer), Conversation(messages=messages), 1 << 30)
    if len(rows) != 1:
        raise BadRow("template_unstable", f"the conversation takes {len(rows)} rows, not one")
    ids, mask = rows[0].input_ids, rows[0].loss_mask
    return Tokenized(ids[:max_len], mask[:max_len], len(ids) > max_len)


# Work is handed to the worker processes in chunks of lines, each closed at CHUNK_LINES lines or
# CHUNK_BYTES bytes, and at most CHUNKS_PER_PROCESS chunks per process are queued or running: the
# processes stay busy while the memory stays flat however long the input.
CHUNK_LINES = 256
CHUNK_BYTES = 1 << 20
CHUNKS_PER_PROCESS = 2


@dataclass
class Part:
    """A chunk of lines tokenized: the output rows as text, the bad rows (line number, reason,
    detail), and the counts, which ``tokenize_chat_file`` sums over the chunks."""

    text: str = ""
    # (line number, where the data stage says the row came from or None, reason, detail)
    bad: list[tuple[int, str | None, str, str]] = field(default_factory=list)
    counts: Counter[str] = field(default_factory=Counter)  # rows_in, tokens, ...: every count
    kinds: Counter[str] = field(default_factory=Counter)  # supervised tokens by kind
    per_conversation: Counter[int] = field(default_factory=Counter)  # conversations by rows
    # conversations in and out by the source the data stage named (rows naming none: not counted)
    by_source: Counter[tuple[str, str]] = field(default_factory=Counter)

    def add(self, other: "Part") -> None:
        """The counts of ``other`` added to these (the text and bad rows are not kept)."""
        self.counts.update(other.counts)
        self.kinds.update(other.kinds)
        self.per_conversation.update(other.per_conversation)
        self.by_source.update(other.by_source)


def policy(reason: str, on_bad_row: str) -> str:
    """What a bad row of ``reason`` does: a row left with no supervised token is always skipped
    and counted, any other follows ``prepare.on_bad_row``."""
    return "skip" if reason == "no_assistant_tokens" else on_bad_row


def tokenize_lines(
    ct: ChatTemplate, lines: list[tuple[int, bytes]], max_len: int, on_bad_row: str
) -> Part:
    """Lines of the chat data (line number, bytes) tokenized: prepare's output rows for them, in
    order, and their counts. A bad row is recorded, not raised; under fail the chunk ends at the
    first one (the caller stops there)."""
    part = Part()
    out = []
    for line_no, line in lines:
        part.counts["rows_in"] += 1
        row = None
        try:
            row = parse_line(line)
            source = row.get(SOURCE) if isinstance(row, dict) else None
            if isinstance(source, str):
                part.by_source[(source, "in")] += 1
            conv = read_conversation(row)
            rows, conv_kinds = tokenize_rows(ct, conv, max_len)
        except BadRow as bad:
            part.bad.append((line_no, origin(row, None), bad.reason, str(bad)))
            if policy(bad.reason, on_bad_row) == "fail":
                break
            continue
        if isinstance(source, str):
            part.by_source[(source, "out")] += 1
        row_id = row.get("id", f"line{line_no}")
        part.counts["truncated_rows"] += sum(len(r.input_ids) > max_len for r in rows)
        kept = [
            Row(r.input_ids[:max_len], r.loss_mask[:max_len], r.turns)
            for r in rows
            if 1 in r.loss_mask[:max_len]
        ]
        for k, r in enumerate(kept):
            out.append(
                json.dumps(
                    {
                        "id": row_id if len(kept) == 1 else f"{row_id}#{k}",
                        "input_ids": r.input_ids,
                        "loss_mask": r.loss_mask,
                        "source_line": line_no,
                    },
                    separators=(",", ":"),
                )
                + "\n"
            )
            part.counts["tokens"] += len(r.input_ids)
            part.counts["loss_masked_tokens"] += sum(r.loss_mask)
        part.counts["unique_tokens"] += unique_tokens(kept)
        part.counts["conversations_out"] += 1
        part.counts["rows_out"] += len(kept)
        part.per_conversation[len(kept)] += 1
        part.kinds.update(conv_kinds)
        # assistant messages kept whose reasoning fields differ
        part.counts["reasoning_fields_disagree"] += len(conv.reasoning_fields_disagree)
    part.text = "".join(out)
    return part


def read_chunks(path: Path) -> Iterator[list[tuple[int, bytes]]]:
    """The non-blank lines of ``path`` (line number, bytes) in chunks of CHUNK_LINES lines or
    CHUNK_BYTES bytes, streamed."""
    chunk: list[tuple[int, bytes]] = []
    size = 0
    for line_no, line in read_lines(path):
        chunk.append((line_no, line))
        size += len(line)
        if len(chunk) == CHUNK_LINES or size >= CHUNK_BYTES:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


# the chat template of a worker process, built once by _start_worker
_worker_template: ChatTemplate | None = None


def _start_worker(load: Callable[[], ChatTemplate]) -> None:
    global _worker_template
    _worker_template = load()


def _worker_lines(lines: list[tuple[int, bytes]], max_len: int, on_bad_row: str) -> Part:
    assert _worker_template is not None, "_start_worker builds the chat template first"
    return tokenize_lines(_worker_template, lines, max_len, on_bad_row)


@contextlib.contextmanager
def tokenized_parts(
    path: Path,
    ct: ChatTemplate,
    max_len: int,
    on_bad_row: str,
    processes: int,
    load: Callable[[], ChatTemplate] | None,
) -> Iterator[Iterator[Part]]:
    """The chunks of ``path`` tokenized, in input order: here with ``ct`` (one process), or by
    ``processes`` worker processes, each with the chat template ``load()`` builds, at most
    CHUNKS_PER_PROCESS chunks per process queued or running. Forked: a worker inherits the
    modules this process imported (a spawned one would import transformers again, seconds)."""
    if processes == 1:
        yield (tokenize_lines(ct, chunk, max_len, on_bad_row) for chunk in read_chunks(path))
        return
    if load is None:
        raise ValueError("tokenizing in worker processes needs `load`, which builds the template")
    pool = ProcessPoolExecutor(
        processes,
        mp_context=multiprocessing.get_context("fork"),
        initializer=_start_worker,
        initargs=(load,),
    )

    def in_order() -> Iterator[Part]:
        pending: deque[Future[Part]] = deque()
        for chunk in read_chunks(path):
            pending.append(pool.submit(_worker_lines, chunk, max_len, on_bad_row))
            if len(pending) == CHUNKS_PER_PROCESS * processes:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()

    try:
        yield in_order()
    except BrokenProcessPool as exc:
        raise UserError(
            f"{path}: a process tokenizing it ended abruptly ({exc}); if the machine ran out of "
            "memory, give the job more or set prepare.num_processes lower"
        ) from None
    finally:  # a chunk still queued is not started (a bad row stopped the run)
        pool.shutdown(wait=True, cancel_futures=True)


def tokenize_chat_file(
    path: Path,
    ct: ChatTemplate,
    max_len: int,
    on_bad_row: str,
    out: IO[str],
    progress: Progress,
    processes: int = 1,
    load: Callable[[], ChatTemplate] | None = None,
) -> dict[str, Any]:
    """Streams the chat data at ``path`` into ``out`` as tokenized rows ``{"id", "input_ids",
    "loss_mask", "source_line"}`` (prepare's output); bad conversations fail or are counted
    (``prepare.on_bad_row``), those left with no supervised token are always dropped and
    counted. Returns the statistics.

    ``processes`` > 1: that many worker processes tokenize chunks of lines (and parse their
    JSON), each with the chat template that ``load`` builds (``functools.partial(load_template,
    verifier, settings)``); this process reads, writes and counts, in input order. The output and
    the statistics are the same bytes for any number of processes, and under fail the first bad
    row in input order is the one named."""
    total = Part()
    drops: Counter[str] = Counter()
    with tokenized_parts(path, ct, max_len, on_bad_row, processes, load) as parts:
        for part in parts:
            for line_no, where, reason, detail in part.bad:
                bad, where = BadRow(reason, detail), where or f"{path}:{line_no}"
                skip_or_fail(drops, bad, where, policy(reason, on_bad_row), SETTING)
            out.write(part.text)
            total.add(part)
            progress.update(part.counts["rows_in"], part.counts["tokens"])
    counts, tokens, unique = total.counts, total.counts["tokens"], total.counts["unique_tokens"]
    return {
        "rows_in": counts["rows_in"],
        "conversations_out": counts["conversations_out"],
        "rows_out": counts["rows_out"],
        "rows_per_conversation": {str(n): c for n, c in sorted(total.per_conversation.items())},
        "tokens": tokens,
        "unique_tokens": unique,
        "extracted_over_unique": round(tokens / unique, 4) if unique else None,
        "loss_masked_tokens": counts["loss_masked_tokens"],
        # of every turn, before rows are cut to max_len
        "supervised_tokens_by_kind": {k: total.kinds.get(k, 0) for k in KINDS},
        "truncated_rows": counts["truncated_rows"],
        "reasoning_fields_disagree": counts["reasoning_fields_disagree"],
        "dropped": dict(sorted(drops.items())),
        # conversations read and kept, by the source the data stage named for them
        "conversations_by_source": {
            name: {"in": total.by_source[(name, "in")], "out": total.by_source[(name, "out")]}
            for name in dict.fromkeys(name for name, _ in total.by_source)
        },
    }


def prepare(io: PrepareIO, p: PrepareParams) -> PrepareStats:
    """The prepare stage's work: ``io.chat_data`` tokenized to ``io.tokenized`` by
    ``p.num_processes`` workers in input order, with the chat template as served; returns the
    statistics."""
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
    return PrepareStats(
        chat_data=str(io.chat_data),
        verifier=str(io.verifier),
        **counts,
        max_seq_len_tokens=p.max_seq_len_tokens,
        chat_template=p.chat_template.model_dump(),
        made_by=made_by("prepare"),
    )
