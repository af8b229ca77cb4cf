"""Human-written prompts for the demo (``demo.corpus: evals``): the prompts of OpenAI's evals
registry, the data files of the pip package ``evals`` (pinned in
envs/requirements-data-packages.txt), read from ``evals/registry/data/`` of the installed
package, never downloaded. The package is installed without its dependencies and never
imported: its directory is found with ``importlib.util.find_spec``, which runs none of its code.

A *task* is a directory under ``registry/data/`` (the first component of a file's path); its rows
are those of every ``*.jsonl`` file under it, the first MAX_LINES lines of each (a few files are
hundreds of MB). A row is a prompt when its ``input`` is a chat (messages with string contents and
roles system, user or assistant, ending with a non-blank user message; earlier assistant messages
are kept, and a message named ``example_user`` or ``example_assistant``, the registry's few-shot
convention, takes that role) or a plain string (one user message). Other layouts, lines that are
not JSON and Git LFS pointer files are skipped; long prompts are kept whole. The row's ``ideal`` (a
string, or the first string of a list) is its reference answer. The demo's verifier answers the
prompts itself (regeneration), so the assistant message of a training row only marks where an
answer goes: the ideal, or PLACEHOLDER where there is none.

Held-out tasks: a stable hash of the task name (crc32, the same for every seed) holds out one task
in EVAL_SHARE; the evaluation prompts come only from those. Duplicates: a prompt is compared by its
roles and contents with whitespace collapsed; one seen before (in file order, over all tasks) is
dropped, and a training prompt that is also a held-out one is dropped from training. Then at most
``max_prompts_per_task`` prompts of each task are drawn with the seeded RNG (no big task
dominates), and the rows go round robin over the tasks in a seeded order (one prompt of each task,
then a second, ...), so that the first N rows come from N tasks while there are that many.

Files are read in the sorted order of their paths, the RNGs are seeded with strings and the split
hashes with crc32, so with the pinned package the same seed gives the same rows on every machine.
For seed 0 and the default cap (evals 3.0.1.post1): 423 tasks with prompts, 90 of them held out;
10,729 training prompts (333 tasks) and 2,867 held-out prompts; building it takes about 3.5 s (a
busy 2-core machine; about 2.5 s of it reading and parsing the files).
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import random
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path

from workflow_scripts.lib.common import UserError

MAX_LINES = 1000  # lines read of each file: 25 times the default cap (2,000: same counts, slower)
EVAL_SHARE = 5  # one task in EVAL_SHARE is held out
PLACEHOLDER = "(no reference answer)"
ROLES = ("system", "user", "assistant")
FEW_SHOT_ROLES = {"example_user": "user", "example_assistant": "assistant"}
LFS_POINTER = b"version https://git-lfs"

Messages = tuple[tuple[str, str], ...]  # (role, content)


@dataclass(frozen=True)
class Prompt:
    task: str
    messages: Messages  # ends with a user message
    reference: str  # "" where the row has none


def registry_data_dir() -> Path:
    """``evals/registry/data`` of the installed package, found without importing it."""
    spec = importlib.util.find_spec("evals")
    if spec is None or not spec.submodule_search_locations:
        raise UserError(
            f"demo.corpus: evals reads the package 'evals' (OpenAI's evals registry), which is not "
            f"installed in {sys.prefix}; `make venv` installs it "
            "(envs/requirements-data-packages.txt)"
        )
    data = Path(spec.submodule_search_locations[0]) / "registry" / "data"
    if not data.is_dir():
        raise UserError(f"demo.corpus: evals: the installed package 'evals' has no {data}")
    return data


def parse_row(line: bytes) -> tuple[Messages, str] | None:
    """(messages, reference) of one JSONL line; None where it is not a prompt."""
    try:
        row = json.loads(line)
    except ValueError:  # not JSON or not UTF-8
        return None
    if not isinstance(row, dict):
        return None
    raw = row.get("input")
    if isinstance(raw, str):
        raw = [{"role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        return None
    messages = []
    for message in raw:
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
            return None
        name, role = message.get("name"), message.get("role")
        if isinstance(name, str) and name in FEW_SHOT_ROLES:
            role = FEW_SHOT_ROLES[name]
        if role not in ROLES:
            return None
        messages.append((role, message["content"]))
    if messages[-1][0] != "user" or not messages[-1][1].strip():
        return None
    ideal = row.get("ideal")
    if isinstance(ideal, list):
        ideal = next((i for i in ideal if isinstance(i, str)), "")
    reference = ideal if isinstance(ideal, str) and ideal.strip() else ""
    return tuple(messages), reference


def read_prompts(data_dir: Path) -> list[Prompt]:
    """Every prompt of the registry's task directories, in file order (sorted paths, then lines)."""
    files = sorted(data_dir.rglob("*.jsonl"), key=lambda p: p.relative_to(data_dir).as_posix())
    prompts = []
    for path in files:
        parts = path.relative_to(data_dir).parts
        if len(parts) < 2 or not path.is_file():
            continue  # not inside a task directory
        with path.open("rb") as f:
            for n, line in enumerate(itertools.islice(f, MAX_LINES)):
                if n == 0 and line.startswith(LFS_POINTER):
                    break
                parsed = parse_row(line)
                if parsed is not None:
                    prompts.append(Prompt(parts[0], *parsed))
    return prompts


def is_held_out(task: str) -> bool:
    return zlib.crc32(task.encode()) % EVAL_SHARE == 0


def prompt_key(messages: Messages) -> Messages:
    """What duplicates are detected on: roles and contents with whitespace collapsed."""
    return tuple((role, " ".join(content.split())) for role, content in messages)


def spread(by_task: dict[str, list[Prompt]], cap: int, rng: random.Random) -> list[Prompt]:
    """At most ``cap`` prompts of each task, drawn with ``rng``, round robin over the tasks in an
    order shuffled with ``rng``."""
    drawn = [rng.sample(by_task[t], min(cap, len(by_task[t]))) for t in sorted(by_task)]
    rng.shuffle(drawn)
    return [p for turn in itertools.zip_longest(*drawn) for p in turn if p is not None]


class EvalsCorpus:
    """Prompts of the evals registry: ``generate_conversations`` (training tasks, the reference
    or PLACEHOLDER as the assistant message) and ``generate_eval_prompts`` (held-out tasks)."""

    def __init__(self, seed: int, max_prompts_per_task: int = 40, data_dir: Path | None = None):
        if max_prompts_per_task < 1:
            raise ValueError(f"max_prompts_per_task must be at least 1, not {max_prompts_per_task}")
        self.seed = seed
        root = data_dir or registry_data_dir()
        prompts = read_prompts(root)
        held_out_keys = {prompt_key(p.messages) for p in prompts if is_held_out(p.task)}
        seen: set[Messages] = set()
        train: dict[str, list[Prompt]] = {}
        held_out: dict[str, list[Prompt]] = {}
        for p in prompts:
            key = prompt_key(p.messages)
            if key in seen or (not is_held_out(p.task) and key in held_out_keys):
                continue
            seen.add(key)
            (held_out if is_held_out(p.task) else train).setdefault(p.task, []).append(p)
        cap = max_prompts_per_task
        self.train = spread(train, cap, random.Random(f"eagle3-evals-train-{seed}"))
        self.held_out = spread(held_out, cap, random.Random(f"eagle3-evals-eval-{seed}"))
        self.train_tasks, self.held_out_tasks = len(train), len(held_out)
        if not self.train or not self.held_out:
            raise UserError(
                f"demo.corpus: evals: {len(self.train)} training and {len(self.held_out)} "
                f"held-out prompts in {root}; the registry is incomplete"
            )

    def summary(self) -> str:
        return (
            f"{self.train_tasks + self.held_out_tasks} tasks of the evals registry: "
            f"{len(self.train)} prompts for training from {self.train_tasks} tasks, "
            f"{len(self.held_out)} held out from {self.held_out_tasks} tasks"
        )

    def generate_conversations(self, num: int) -> list[dict]:
        """The first ``num`` training prompts, each with its reference (or PLACEHOLDER) as the
        assistant message."""
        if num > len(self.train):
            raise ValueError(f"the evals corpus has only {len(self.train)} training prompts")
        return [
            {
                "id": f"evals-{self.seed}-{n:06d}",
                "messages": [{"role": r, "content": c} for r, c in p.messages]
                + [{"role": "assistant", "content": p.reference or PLACEHOLDER}],
            }
            for n, p in enumerate(self.train[:num])
        ]

    def generate_eval_prompts(self, num: int) -> list[dict]:
        """The first ``num`` held-out prompts (ending with a user message), the task under
        ``family`` and the row's ideal (or "") under ``reference``."""
        if num > len(self.held_out):
            raise ValueError(f"the evals corpus has only {len(self.held_out)} held-out prompts")
        return [
            {
                "id": f"evals-eval-{self.seed}-{n:04d}",
                "family": p.task,
                "messages": [{"role": r, "content": c} for r, c in p.messages],
                "reference": p.reference,
            }
            for n, p in enumerate(self.held_out[:num])
        ]
