"""Regeneration (self-distillation), everything but the entry: the verifier writes the assistant
turns of the chat data itself.

A draft learns to predict the verifier, and it learns best from text the verifier writes. This
stage keeps each conversation's system and user messages and has the verifier (real vLLM) answer
every user turn, turn by turn, with the conversation so far (its own earlier answers included),
rendered by its chat template as it is served (``chat_template``). The original assistant
messages only mark where an answer goes; one is also written after a conversation's last user
turn. Each answer keeps exactly what the verifier did: the ids it was served and the ids it
sampled (``regenerated_ids`` on the message, which prepare trains on as they are), and its text
split into reasoning and answer where the template has a reasoning format.

Tool calls: the turns before a conversation's first tool-calling assistant turn are answered;
from that turn on, the conversation is kept as the data has it (its calls, their results and the
answers after them), so that no tool result is ever paired with a call it does not answer.

* Before the model loads, one pass over the input finds malformed rows (bad JSON, unknown role,
  no user turn): ``on_bad_row`` fail stops with file:line, skip counts them.
* Conversations are answered in batches of ``batch_size_samples``: one engine call per turn
  round. Each finished batch is written to ``work_dir`` as one file, atomically, with a
  fingerprint of what it depends on (its own rows, verifier, generation settings). A restarted
  job reuses the finished batches with the same fingerprint and removes the others, and so does
  a run over chat data that grew at its end (every full batch before the new rows). Sampling is
  seeded per conversation and turn, so the output does not depend on where a run was resumed.
* A turn that stops at the token limit (``max_new_tokens_per_turn``, or the engine's max length)
  is counted, and its conversation is kept and flagged (``regenerate.length_limited_turns`` in the
  row) or dropped (``on_length_limit``). A conversation that outgrows the engine's max length
  ends at its last answered turn, counted.
* Output: JSONL rows ``{"id", "messages", "regenerate": {...}}`` in input order, which prepare
  reads like any chat data; and a stats file.
"""

from __future__ import annotations

import hashlib
import logging
import re
from array import array
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from workflow_scripts.lib.chat.rows import (
    SOURCE,
    SOURCE_ROW,
    BadRow,
    normalize,
    origin,
    parse_line,
    row_message,
    skip_or_fail,
)
from workflow_scripts.lib.chat.template import ChatTemplate
from workflow_scripts.lib.common import Progress, UserError
from workflow_scripts.lib.regeneration.records import AnswerBatch, AnswerCounts
from workflow_scripts.lib.verifier import engine
from workflow_scripts.lib.verifier import files as verifier_files
from workflow_scripts.lib.workflow.code_inputs import resume_key, stage_fingerprint

log = logging.getLogger("eagle3")
SETTING = "regenerate.on_bad_row"
FORMAT_VERSION = 2  # bump when the way answers are generated changes: finished batches are redone


# --------------------------------------------------------------------------- conversations


def answer_plan(messages: list[dict[str, Any]]) -> list[dict[str, Any] | None]:
    """The conversation to write, as its system and user messages with ``None`` where the
    verifier answers: after each user turn that the original follows with an assistant message,
    and after the last message if it is a user turn. Assistant messages that follow no user
    turn (a leading greeting, a second one in a row) are left out. From the first assistant turn
    with tool calls on, every message is kept as it is, and none is answered."""
    plan: list[dict[str, Any] | None] = []
    for i, msg in enumerate(messages):
        if msg["role"] == "assistant" and msg.get("tool_calls"):
            if not any(m is not None and m["role"] == "user" for m in plan):
                break
            return plan + messages[i:]  # kept as it is from here (answered or not before)
        if msg["role"] == "assistant":
            if plan and plan[-1] is not None and plan[-1]["role"] == "user":
                plan.append(None)
        else:
            plan.append(msg)
    else:
        if plan and plan[-1] is not None and plan[-1]["role"] == "user":
            plan.append(None)
    if None not in plan:
        raise BadRow("no_user_turn", "the conversation has no user turn to answer")
    return plan


def read_row(line: bytes) -> tuple[Any, Any, list[dict[str, Any] | None]]:
    """(the parsed row, its Conversation, its answer plan)."""
    row = parse_line(line)
    conv = normalize(row)
    return row, conv, answer_plan(conv.messages)


@dataclass
class Index:
    """What the pass over the input found: where its usable rows start, their line numbers,
    the bad rows by reason, the sha256 of the file's bytes and of each batch's rows (their line
    numbers and bytes: what a batch's answers are computed from)."""

    offsets: array = field(default_factory=lambda: array("q"))
    line_nos: array = field(default_factory=lambda: array("q"))
    bad: Counter = field(default_factory=Counter)
    rows_in: int = 0
    sha256: str = ""
    batch_sha256: list[str] = field(default_factory=list)


def index_input(path: Path, p, template: ChatTemplate | None = None) -> Index:
    """One streaming pass: every row parsed and checked, and with ``template`` its first prompt
    measured against the engine's max length; only offsets are kept (flat memory)."""
    index = Index()
    digest = hashlib.sha256()
    batches: list[Any] = []  # each batch's sha256, of p.batch_size_samples usable rows
    pos = 0
    progress = Progress("regenerate: checking rows", total=None, interval_s=p.progress_interval_s)
    with open(path, "rb") as fh:
        for line_no, line in enumerate(fh, start=1):
            digest.update(line)
            start, pos = pos, pos + len(line)
            if not line.strip():
                continue
            index.rows_in += 1
            row = None
            try:
                row = parse_line(line)
                conv = normalize(row)
                plan = answer_plan(conv.messages)
                if template is not None:
                    check_first_prompt(template, plan, conv.tools, p.max_model_len_tokens)
            except BadRow as bad:
                where = origin(row, f"{path}:{line_no}")
                skip_or_fail(index.bad, bad, where, p.on_bad_row, SETTING)
                continue
            if len(index.offsets) % p.batch_size_samples == 0:
                batches.append(hashlib.sha256())
            batches[-1].update(f"{line_no}:".encode() + line)
            index.offsets.append(start)
            index.line_nos.append(line_no)
            progress.update(1)
    index.sha256 = digest.hexdigest()
    index.batch_sha256 = [b.hexdigest() for b in batches]
    return index


def too_long(n_tokens: int, max_len: int) -> BadRow:
    return BadRow(
        "too_long",
        f"its first prompt has {n_tokens} tokens, and the engine must generate at least one "
        f"within regenerate.max_model_len_tokens ({max_len}); raise it",
    )


def check_first_prompt(
    template: ChatTemplate, plan: list[dict[str, Any] | None], tools, max_len: int
) -> None:
    """The first prompt fits the engine, and the chat template takes the whole conversation
    (with a stand-in for each answer), so that no row fails once the model has loaded."""
    if None in plan:  # else it is kept as the data has it: nothing is generated
        n = len(template.prompt_ids(plan[: plan.index(None)], tools))
        if n >= max_len:
            raise too_long(n, max_len)
    template.render([m or {"role": "assistant", "content": "answer"} for m in plan], tools)


@dataclass
class Conversation:
    """One conversation being answered: the messages written so far and what is left."""

    row_id: Any
    line_no: int
    where: str  # the file and row it came from (the data stage's), else file:line
    plan: list[dict[str, Any] | None]
    tools: list[Any] | None = None
    source: str | None = None  # the name of its source (the data stage's)
    messages: list[dict[str, Any]] = field(default_factory=list)
    answered: int = 0
    length_limited_turns: list[int] = field(default_factory=list)
    context_full: bool = False
    bad: BadRow | None = None
    served: tuple[str, list[int]] | None = None  # the prompt of the turn being answered

    def next_prompt(self) -> list[dict[str, Any]] | None:
        """Copies the plan's messages up to the next answer; the messages to answer, or None
        when the conversation is complete."""
        while self.plan:
            item = self.plan.pop(0)
            if item is None:
                return self.messages
            self.messages.append(item)
        return None

    def finish(self) -> None:
        """Ends the conversation at its last answer (the engine's max length is reached)."""
        self.plan = []
        while self.messages and self.messages[-1]["role"] != "assistant":
            self.messages.pop()
        self.context_full = True


def turn_seed(seed: int, line_no: int, turn: int) -> int:
    blob = f"{seed}:{line_no}:{turn}".encode()
    return int.from_bytes(hashlib.sha256(blob).digest()[:4], "little") & 0x7FFFFFFF


# --------------------------------------------------------------------------- one batch


def answer_batch(
    llm, template: ChatTemplate, p, convs: list[Conversation], progress: Progress | None = None
) -> Counter:
    """Answers every conversation of the batch, one engine call per turn round; returns token
    counts (each round's generated tokens also go to ``progress``). Conversations whose first
    prompt does not fit get ``bad`` set."""
    from vllm import SamplingParams

    stops = template.stop_ids
    counts: Counter = Counter()
    active = [(c, c.next_prompt()) for c in convs]
    active = [(c, m) for c, m in active if m is not None]
    while active:
        prompts, params, waiting = [], [], []
        for conv, messages in active:
            text = template.render(messages, conv.tools, generation_prompt=True)
            ids = template.encode(text)
            room = p.max_model_len_tokens - len(ids)
            if room < 1:
                if conv.answered == 0:  # found before the model loads; kept as a safeguard
                    conv.bad = too_long(len(ids), p.max_model_len_tokens)
                else:
                    conv.finish()
                continue
            prompts.append({"prompt_token_ids": ids})
            conv.served = (text, ids)
            params.append(
                SamplingParams(
                    temperature=p.temperature,
                    top_p=p.top_p,
                    max_tokens=min(p.max_new_tokens_per_turn, room),
                    seed=turn_seed(p.seed, conv.line_no, conv.answered),
                    stop_token_ids=stops,
                    detokenize=False,
                )
            )
            waiting.append(conv)
            counts["prompt_tokens"] += len(ids)
        outputs = llm.generate(prompts, params, use_tqdm=False) if prompts else []
        if progress is not None:
            progress.update(0, sum(len(o.outputs[0].token_ids) for o in outputs))
        for conv, out in zip(waiting, outputs):
            gen = out.outputs[0]
            sampled = list(gen.token_ids)
            text, ids = conv.served
            msg = template.answer_message(text, sampled)
            reasoning, answer = msg.get("reasoning"), msg["content"]
            msg["regenerated_ids"] = {"prompt": ids, "generated": sampled}
            conv.messages.append(msg)
            if gen.finish_reason == "length":
                conv.length_limited_turns.append(conv.answered)
            conv.answered += 1
            counts["generated_tokens"] += len(gen.token_ids)
            counts["turns"] += 1
            counts["reasoning_turns"] += bool(reasoning)
            counts["empty_answers"] += not (answer or reasoning)
        active = [(c, c.next_prompt()) for c in waiting]
        active = [(c, m) for c, m in active if m is not None]
    return counts


def batch_result(p, convs: list[Conversation], counts: Counter, key: str) -> AnswerBatch:
    """The rows to write and the batch's statistics, under its resume key ``key``; a too-long
    first prompt fails or is skipped here (on_bad_row)."""
    rows, bad = [], Counter()
    stats = Counter(counts)
    for conv in convs:
        if conv.bad is not None:
            skip_or_fail(bad, conv.bad, conv.where, p.on_bad_row, SETTING)
            continue
        stats["length_limited_turns"] += len(conv.length_limited_turns)
        stats["length_limited_conversations"] += bool(conv.length_limited_turns)
        stats["context_full_conversations"] += conv.context_full
        if conv.length_limited_turns and p.on_length_limit == "drop":
            stats["dropped_length_limited"] += 1
            continue
        rows.append(
            {
                "id": conv.row_id,
                "messages": [row_message(m) for m in conv.messages],
                **({"tools": conv.tools} if conv.tools else {}),
                **({SOURCE: conv.source} if conv.source else {}),
                SOURCE_ROW: conv.where,
                "regenerate": {
                    "source_line": conv.line_no,
                    "turns": conv.answered,
                    "length_limited_turns": conv.length_limited_turns,
                    "context_full": conv.context_full,
                },
            }
        )
    stats["rows_out"] = len(rows)
    return AnswerBatch(fingerprint=key, rows=rows, stats=AnswerCounts(**stats), bad=dict(bad))


# --------------------------------------------------------------------------- batches on disk


def batch_keys(io, p, index: Index, dtype: str) -> list[str]:
    """Each batch's resume key: what its answers depend on, its own rows (their line numbers and
    bytes: a row's turn seeds come from its line), the verifier, the code of the regenerate
    stage, the settings that change answers, batch boundaries or which rows a batch keeps. Not:
    the rest of the input (chat data grown at its end reuses every full batch before), paths, the
    number of jobs, the engine's memory and speed settings."""
    key = {
        "format_version": FORMAT_VERSION,
        "verifier": verifier_files.fingerprint(io.verifier),
        "dtype": dtype,
        "chat_template": p.chat_template.model_dump(mode="json"),
        **p.model_dump(
            include={
                "temperature",
                "top_p",
                "max_new_tokens_per_turn",
                "seed",
                "batch_size_samples",
                "max_model_len_tokens",
                "on_bad_row",
                "on_length_limit",
            }
        ),
    }
    code = stage_fingerprint("regenerate")
    return [resume_key({**key, "rows_sha256": rows}, code) for rows in index.batch_sha256]


def batch_path(work_dir: Path, b: int) -> Path:
    return work_dir / f"batch-{b:06d}.json"


def load_batch(path: Path, expected: str) -> AnswerBatch | None:
    """The finished batch in ``path`` if it was computed for the resume key ``expected``."""
    try:
        batch = AnswerBatch.read(path)
    except UserError:  # cut short, or written by other code
        return None
    return batch if batch.fingerprint == expected else None


BATCH_FILE = re.compile(r"^\.?batch-(\d{6})\.json(\.tmp-\d+)?$")


def clean_work_dir(
    work_dir: Path, expected: list[str], job_index: int = 0, num_jobs: int = 1
) -> list[int]:
    """This job's batches (b % num_jobs == job_index) finished under their resume keys
    (``expected[b]``: ``batch_keys``); its other batch files (stale, cut short, partial) are
    removed, and by job 0 also those past the last batch. Other jobs' files are theirs to judge:
    they may be writing them right now."""
    work_dir.mkdir(parents=True, exist_ok=True)
    num_batches = len(expected)
    done, removed = [], 0
    for path in sorted(work_dir.iterdir()):
        match = BATCH_FILE.match(path.name)
        if match is None:
            continue
        b = int(match.group(1))
        mine = b % num_jobs == job_index if b < num_batches else job_index == 0
        if not mine:
            continue
        if b < num_batches and not match.group(2) and load_batch(path, expected[b]) is not None:
            done.append(b)
            continue
        path.unlink()
        removed += 1
    if removed:
        log.info("regenerate: removed %d stale or partial batch file(s) from %s", removed, work_dir)
    return done


def read_conversations(path: Path, index: Index, indices: range) -> Iterator[Conversation]:
    with open(path, "rb") as fh:
        for i in indices:
            fh.seek(index.offsets[i])
            row, conv, plan = read_row(fh.readline())
            line_no = index.line_nos[i]
            row_id = row.get("id", f"line{line_no}")
            where = origin(row, f"{path}:{line_no}")
            yield Conversation(
                row_id, line_no, where, plan=plan, tools=conv.tools, source=row.get(SOURCE)
            )


# --------------------------------------------------------------------------- engine


def make_engine(io, p, dtype: str):
    kwargs = engine.engine_args(
        p,
        io.verifier,
        dtype,
        seed=p.seed,
        enable_prefix_caching=True,  # a conversation's next turn starts with its previous prompt
        max_num_seqs=p.batch_size_samples,
        max_num_batched_tokens=max(p.batch_budget_tokens, p.max_model_len_tokens),
        disable_log_stats=True,
    )
    return engine.make_llm(kwargs, use_gpus=p.use_gpus)
