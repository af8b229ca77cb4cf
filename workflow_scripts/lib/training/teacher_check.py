"""The teacher proven equal to the verifier: extraction records, for one sample of each shard, the
verifier's own next-token choice at the positions whose final state the shard stores, as its
engine computes it (``hidden_states/teacher_record.py``); training computes its teacher (final
norm and lm_head over the stored final states, ``draft/teacher_head.py``) there before the first
step, and stops, naming the difference, when the two disagree beyond rounding.

A teacher can be wrong without anything else noticing: Gemma's final norm is ``x * (1 + w)``,
some families soft-cap or scale their logits; a draft trained against another distribution than
the verifier's would only serve worse. Positions where the teacher's own top two logits are
within rounding of each other are left out (a bfloat16 engine against a float32 teacher can
order those either way).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from workflow_scripts.lib.common import UserError
from workflow_scripts.lib.hidden_states.records import Header, ShardRecord
from workflow_scripts.lib.hidden_states.shards import ShardReader

# Positions are decided where the teacher's top-1 logit leads its second by more than rounding
# can move them: a share of the top-1 logit's size, by the coarser of the engine's compute dtype
# and the shards' storage dtype.
ROUNDING = {"float32": 1e-3, "float16": 5e-3, "bfloat16": 2e-2, "float8_e4m3fn": 1e-1}
MIN_AGREEMENT = 0.98  # of the decided positions
log = logging.getLogger("eagle3")


@torch.no_grad()
def verify(
    header: Header, shards: list[ShardRecord], teacher, device, verifier: Path | str
) -> dict[str, Any]:
    """The teacher's top-1 against the recorded one at every checked position of ``shards`` (of
    the manifest or stream plan ``header``); a UserError when they disagree. Returns the counts
    (logged by the caller)."""
    tol = max(ROUNDING.get(header.dtype, 2e-2), ROUNDING.get(header.storage_dtype, 1e-1))
    checked = agree = undecided = 0
    first_wrong: list[tuple[int, int, int]] = []
    for entry in shards:
        check = entry.teacher_check
        if not check:
            continue
        sample = ShardReader(Path(entry.path)).sample(int(check["sample"]))
        pos = torch.tensor(check["positions"], dtype=torch.long)
        final = sample.final_hidden_states[pos].to(device)
        logits = teacher.full_logits(final)
        top2 = logits.topk(2, dim=-1)
        lead = top2.values[:, 0] - top2.values[:, 1]
        decided = lead > tol * (top2.values[:, 0].abs() + 1)
        ours = top2.indices[:, 0].cpu()
        recorded = torch.tensor(check["top1"], dtype=torch.long)
        undecided += int((~decided).sum())
        d = decided.cpu()
        checked += int(d.sum())
        agree += int((ours[d] == recorded[d]).sum())
        for i in torch.nonzero(d & (ours != recorded)).flatten().tolist()[:3]:
            if len(first_wrong) < 5:
                first_wrong.append((int(pos[i]), int(recorded[i]), int(ours[i])))
    result = {"checked": checked, "agree": agree, "undecided": undecided}
    if checked == 0:
        return result
    if agree < MIN_AGREEMENT * checked:
        examples = ", ".join(f"position {p}: verifier {a}, teacher {b}" for p, a, b in first_wrong)
        raise UserError(
            f"the teacher built from {verifier}'s final norm and lm_head agrees with the "
            f"verifier's own next-token choice (recorded by extraction) at only {agree} of "
            f"{checked} positions ({examples}): training would learn another distribution than "
            "the verifier's. The verifier's family computes its head differently (a norm with "
            "an offset, soft-capped or scaled logits) from what draft/teacher_head.py knows for "
            "its config, or the shards come from another verifier; stopping before the first step"
        )
    return result


def verify_and_log(
    header: Header, teacher, d, verifier: Path | str, shards: list[ShardRecord] | None = None
) -> None:
    """``verify`` of ``shards`` (by default the manifest ``header``'s), before any step, its
    counts logged by the first process."""
    check = verify(header, header.shards if shards is None else shards, teacher, d.device, verifier)
    if d.main:
        log.info(
            "teacher check: the teacher's top-1 is the verifier's at %d of %d recorded "
            "positions (%d left out: within rounding)%s",
            check["agree"],
            check["checked"],
            check["undecided"],
            "" if check["checked"] else "; none recorded (shards from before the check)",
        )
