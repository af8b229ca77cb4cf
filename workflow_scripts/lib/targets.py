"""Which stages each target a user may ask for needs (the Snakefile's rules and their DAG), so
that the dry-run's problem of a stage no requested target needs is a warning, not an error
(``by_targets``). Read by every layer's checks: lib/workflow/checks.py, lib/verifier/preflight.py
and cluster.py, lib/hidden_states/estimate.py and lib/dryrun.py.
"""

from __future__ import annotations

# The stages whose settings the dry-run checks one by one, and those of them that each rule a user
# may ask for needs: its own stage and every stage upstream of it (Snakefile, rules/*.smk). A
# problem of a stage no requested target needs is a warning, not an error. A target not named
# here (a file, a new rule) is checked for every stage, as `all` is. tests/test_dry_run_targets.py
# holds this table to the rules' DAG.
TARGET_STAGES: dict[str, frozenset[str]] = {
    "all": frozenset({"regenerate", "extract", "train", "evaluate"}),
    "evaluate": frozenset({"regenerate", "extract", "train", "evaluate"}),
    "evaluate_draft": frozenset({"regenerate", "extract", "train", "evaluate"}),
    "evaluate_reference": frozenset({"evaluate"}),
    "draft_ckpt": frozenset({"regenerate", "extract", "train"}),
    "export_sglang": frozenset({"regenerate", "extract", "train"}),
    "export_trtllm": frozenset({"regenerate", "extract", "train"}),
    "export": frozenset({"regenerate", "extract", "train"}),
    "train": frozenset({"regenerate", "extract", "train"}),
    "hidden_states": frozenset({"regenerate", "extract"}),
    "extract_merge": frozenset({"regenerate", "extract"}),
    "extract": frozenset({"regenerate", "extract"}),
    "extract_plan": frozenset({"regenerate", "extract"}),
    "vocab_map": frozenset({"regenerate"}),
    "data": frozenset(),
    "vocab": frozenset({"regenerate"}),
    "prepare": frozenset({"regenerate"}),
    "regenerate_merge": frozenset({"regenerate"}),
    "regenerate": frozenset({"regenerate"}),
    "resolved_config": frozenset(),
    "demo": frozenset(),
}
DEFAULT_TARGET = "all"  # the Snakefile's default_target
# the Snakefile's targets besides `all`, from the one that needs the most stages
SNAKEFILE_TARGETS = ("evaluate", "draft_ckpt", "hidden_states", "vocab_map")


def stages_needed(target: str) -> frozenset[str]:
    """The checked stages ``target`` (a rule name or a file) needs: every one for a file."""
    return TARGET_STAGES.get(target, TARGET_STAGES[DEFAULT_TARGET])


def _listed(names: list[str]) -> str:
    """'a', 'a and b', 'a, b and c'."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def by_targets(
    problems: dict[str, list[str]], targets: list[str] | tuple[str, ...]
) -> tuple[list[str], list[str]]:
    """``problems``, by the stage whose settings they concern, as (errors, warnings): an error
    where one of the requested ``targets`` needs the stage, naming those targets; a warning
    otherwise, naming the Snakefile's targets that cannot be built. Both say which can."""
    errors, warnings = [], []
    for stage, found in problems.items():
        requested = [t for t in dict.fromkeys(targets) if stage in stages_needed(t)]
        stopped = [t for t in SNAKEFILE_TARGETS if stage in TARGET_STAGES[t]]
        can = [t for t in SNAKEFILE_TARGETS if stage not in TARGET_STAGES[t]]
        tail = f"; {_listed(can)} can" if can else ""
        for why in found:
            if requested:
                s = "s" if len(requested) > 1 else ""
                errors.append(f"target{s} {_listed(requested)} cannot be built: {why}{tail}")
            else:
                s = "s" if len(stopped) > 1 else ""
                warnings.append(
                    f"target{s} {_listed(stopped)} (and all) cannot be built: {why}{tail}"
                )
    return errors, warnings
