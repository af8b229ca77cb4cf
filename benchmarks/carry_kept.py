"""Carries kept benchmark runs (benchmarks/results/<bench>/<variant>@<seed>.json) over to this
checkout's code fingerprints, for a change that moved the fingerprints without changing what the
stages compute (a new definition of the fingerprint, a refactor): in each kept run, every stage
whose recorded fingerprint is the one commit ``--from`` gives that stage gets this checkout's.
A stage whose recorded fingerprint is another commit's is left as it is (that run stays stale on
it). Whether the code computes the same is for the change to show before this runs, the embedded
default built by both commits byte for byte, and for its commit message to say. A stage split
out of another (``--split NEW=OLD``: evaluate_reference out of evaluate) is added to each run
whose OLD is carried, with this checkout's fingerprint.

    python benchmarks/carry_kept.py --from 3b740ab           # what would change
    python benchmarks/carry_kept.py --from 3b740ab --write   # rewrite the kept runs
    python benchmarks/carry_kept.py --from 8ad7c1b --split evaluate_reference=evaluate --write
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KEPT = ROOT / "benchmarks" / "results"
FINGERPRINTS = """
import json, sys
from workflow_scripts.lib.workflow.code_inputs import stage_fingerprint
from workflow_scripts.lib.workflow.registry import STAGES
print(json.dumps({stage: stage_fingerprint(stage) for stage in sys.argv[1:] if stage in STAGES}))
"""  # (a stage the commit does not have yet has no fingerprint there)


def fingerprints(tree: Path, stages: list[str]) -> dict[str, str]:
    """Each of ``stages``' code fingerprint as the code in ``tree`` computes it."""
    out = subprocess.run(
        [sys.executable, "-c", FINGERPRINTS, *stages],
        cwd=tree,
        env={"PYTHONPATH": str(tree), "PATH": ""},
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout)


def at_commit(commit: str, stages: list[str]) -> dict[str, str]:
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", commit, "workflow_scripts"],
        capture_output=True,
        check=True,
    ).stdout
    with tempfile.TemporaryDirectory() as tmp:
        with tarfile.open(fileobj=BytesIO(archive)) as tar:
            tar.extractall(tmp, filter="data")
        return fingerprints(Path(tmp), stages)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--from", dest="commit", required=True, help="the commit the runs match")
    parser.add_argument("--write", action="store_true", help="rewrite the kept runs")
    parser.add_argument(
        "--split",
        action="append",
        default=[],
        metavar="NEW=OLD",
        help="stage NEW was split out of stage OLD: a run whose OLD is carried gets NEW too",
    )
    args = parser.parse_args()
    splits = dict(pair.split("=", 1) for pair in args.split)
    runs = sorted(KEPT.glob("*/*@*.json"))
    stages = sorted({s for path in runs for s in json.loads(path.read_text())["code"]})
    old, new = at_commit(args.commit, stages), fingerprints(ROOT, [*stages, *splits])
    for path in runs:
        run = json.loads(path.read_text())
        carried = [s for s, f in run["code"].items() if f == old.get(s) and f != new[s]]
        stale = [s for s, f in run["code"].items() if f not in (old.get(s), new[s])]
        for split, whole in splits.items():
            if split not in run["code"] and run["code"].get(whole) == old[whole]:
                run["code"][split] = new[split]
                carried.append(split)
        print(
            f"{path.relative_to(KEPT)}: carried {len(carried)} of {len(run['code'])} stages"
            + (f"; stale on {', '.join(stale)} (left as recorded)" if stale else "")
        )
        if carried and args.write:
            run["code"].update({s: new[s] for s in carried})
            path.write_text(json.dumps(run, indent=1) + "\n")


if __name__ == "__main__":
    main()
