"""A stage's data-parallel jobs (``<section>.num_jobs``; regenerate's batches, extract's shards):
job ``i`` of ``N`` takes the units ``u`` with ``u % N == i``, reuses those it finished under the
same resume key (lib/workflow/code_inputs.py: ``resume_key``), and writes a part; the merge takes
one part per job and every unit exactly once.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from workflow_scripts.lib.common import UserError


def job_units(job_index: int, num_jobs: int, num_units: int, section: str) -> range:
    """The units of job ``job_index`` of ``num_jobs``, of ``num_units``."""
    if not 0 <= job_index < num_jobs:
        raise UserError(f"job index {job_index} is not below {section}.num_jobs {num_jobs}")
    return range(job_index, num_units, num_jobs)


def check_parts(
    job_indices: list[int],
    units: list[Iterable[int]],
    num_jobs: int,
    num_units: int,
    what: str,
    hint: str,
) -> None:
    """That the parts (each job's index and units: ``what``, e.g. "batches") are one per job and
    cover every unit once."""
    if sorted(job_indices) != list(range(num_jobs)):
        raise UserError(
            f"parts of jobs {sorted(job_indices)}, expected one for each of 0..{num_jobs - 1}; "
            f"{hint}"
        )
    owners = Counter(u for owned in units for u in owned)
    twice = sorted(u for u, n in owners.items() if n > 1)
    if twice:
        raise UserError(f"{what} {twice[:10]} are in two parts; {hint}")
    missing = sorted(set(range(num_units)) - set(owners))
    if missing or len(owners) != num_units:
        raise UserError(f"{what} {missing[:10]} are in no part; {hint}")
