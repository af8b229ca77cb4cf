"""The records regeneration's jobs hand its merge: each batch of answers (``batch-NNNNNN.json`` in
the work directory, the unit a restarted job reuses) and each job's part. The merge writes
``RegenerateStats`` (lib/workflow/records.py), which the dry-run reads too.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from workflow_scripts.lib.common import atomic_path
from workflow_scripts.lib.workflow.records import MadeBy, Record


class AnswerCounts(Record):
    """What the verifier's answers count: one batch's, or a whole regeneration's."""

    turns: int = 0
    reasoning_turns: int = 0
    empty_answers: int = 0
    length_limited_turns: int = 0
    length_limited_conversations: int = 0
    dropped_length_limited: int = 0
    context_full_conversations: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    rows_out: int = 0

    def __add__(self, other: AnswerCounts) -> AnswerCounts:
        return AnswerCounts(**{k: getattr(self, k) + getattr(other, k) for k in self.model_fields})


class AnswerBatch(Record):
    """One batch of conversations answered: the rows written (chat rows, as the data stage's),
    what they count and the bad rows skipped, under the resume key they were computed for."""

    fingerprint: str
    rows: list[dict[str, Any]]
    stats: AnswerCounts
    bad: dict[str, int]

    def write(self, path: Path) -> None:
        with atomic_path(path) as tmp:
            tmp.write_text(json.dumps(self.model_dump(mode="json"), ensure_ascii=False))


class RegeneratePart(Record):
    """What job ``job_index`` of ``num_jobs`` answered: its batches (``b % num_jobs ==
    job_index``), and what every job's part must agree on: among it the input's sha256 and every
    batch's resume key (answers.py: ``batch_keys``), which the merge holds each batch to."""

    input_sha256: str
    batch_keys: list[str]
    chat_data: str
    verifier: str
    num_jobs: int
    job_index: int
    num_batches: int
    batches: list[int]
    batches_reused: int
    rows_in: int
    bad_rows: dict[str, int]
    seconds: float
    params: dict[str, Any]
    made_by: MadeBy
