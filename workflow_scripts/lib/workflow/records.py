"""The base of the records stages hand each other (lib/hidden_states/records.py, lib/regeneration/
records.py): a pydantic model per file, with exactly the fields written, read and written only
through it; and the ``made_by`` header every record carries (lib/workflow/code_inputs.py:
``made_by``). The field order is the file's key order.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from workflow_scripts.lib.common import UserError, write_json


class Record(BaseModel):
    """A record's fields are exactly those written: a missing or unknown key is refused."""

    model_config = ConfigDict(extra="forbid")

    @classmethod
    def read(cls, path: Path):
        """The record in ``path``; a UserError naming the file and the field where it is not one."""
        try:
            return cls.model_validate(json.loads(Path(path).read_text()))
        except (OSError, json.JSONDecodeError) as exc:
            raise UserError(f"cannot read {path}: {exc}") from None
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise UserError(
                f"{path}: not a {cls.__name__} of this workflow ({where}: {first['msg']}); "
                "rerun the stage that wrote it"
            ) from None

    def write(self, path: Path) -> None:
        write_json(path, self.model_dump(mode="json", exclude_unset=True))


class MadeBy(Record):
    """What made a record: the fingerprint of the code that computed it (lib/workflow/
    code_inputs.py) and the versions of vLLM, torch and transformers."""

    code: str
    versions: dict[str, str]


# The summaries of the stages that prepare the data, read by later stages' checks and by the
# dry-run's estimate (lib/dryrun.py, lib/hidden_states/estimate.py).


class PrepareStats(Record):
    """``<results_dir>/prepare/stats.json``: what prepare tokenized, and with what."""

    chat_data: str
    verifier: str
    rows_in: int
    conversations_out: int
    rows_out: int
    rows_per_conversation: dict[str, int]
    tokens: int
    unique_tokens: int
    extracted_over_unique: float | None
    loss_masked_tokens: int
    supervised_tokens_by_kind: dict[str, int]
    truncated_rows: int
    reasoning_fields_disagree: int
    conversations_by_source: dict[str, dict[str, int]]
    max_seq_len_tokens: int
    chat_template: dict[str, Any]
    dropped: dict[str, int]
    made_by: MadeBy


class RegenerateStats(Record):
    """``<results_dir>/regenerate/stats.json``: what regeneration answered, in how many batches
    and jobs, and with what settings."""

    chat_data: str
    verifier: str
    rows_in: int
    rows_out: int
    bad_rows: dict[str, int]
    turns: int
    reasoning_turns: int
    empty_answers: int
    length_limited_turns: int
    length_limited_conversations: int
    dropped_length_limited: int
    context_full_conversations: int
    prompt_tokens: int
    generated_tokens: int
    batches: int
    batches_reused: int
    jobs: int
    job_seconds: list[float]
    params: dict[str, Any]
    made_by: MadeBy


class MetricsRow(Record):
    """One line of training's ``metrics.jsonl``: a training step's figures (split ``train``), a
    validation's (``val``), or, last, the validation whose weights the draft has (``selected``),
    which evaluate sets beside what vLLM measures. Per TTT step: the KL, top-1 agreement inside
    the draft vocabulary and over the verifier's, and the positions counted; per draft position:
    the share of anchors whose drafts vLLM would all accept (greedy)."""

    step: int
    split: Literal["train", "val", "selected"]
    epoch: int | None = None  # the rest of train's own figures are after the shared ones
    loss: float
    kl_per_step: list[float]
    top1_agreement: list[float]
    top1_agreement_full_vocab: list[float]
    acceptance_per_position: list[float]
    simulated_acceptance_length: float
    positions_per_step: list[int]
    walked_acceptance_by_k: list[float] | None = None  # validations: k = 1.. as vLLM counts
    lr: float | None = None
    grad_norm: float | None = None
    tokens: int | None = None
    tokens_per_s: float | None = None
    elapsed_s: float | None = None
    eta_s: float | None = None

    def line(self) -> str:
        """The row as its line of metrics.jsonl (the fields it was given, in order)."""
        return json.dumps(self.model_dump(exclude_unset=True)) + "\n"

    @classmethod
    def read_all(cls, path: Path) -> list[MetricsRow]:
        """Every row of the metrics file ``path`` (none where it does not exist)."""
        if not Path(path).exists():
            return []
        lines = Path(path).read_text().splitlines()
        try:
            return [cls.model_validate_json(line) for line in lines if line.strip()]
        except ValidationError as exc:
            raise UserError(
                f"{path}: not training's metrics of this workflow ({exc.errors()[0]['msg']}); "
                "rerun the train stage"
            ) from None
