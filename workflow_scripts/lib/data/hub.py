"""Hub datasets pinned to a commit: a branch or tag (``revision``, main when null) is resolved
once, when the workflow is first planned, and recorded in ``<results_dir>/sources.lock.json``;
every later run reads the recorded commit, so that a run next month trains on the same rows. When
the hub is reachable and the branch has moved since, the plan says so and keeps the recorded
commit (delete its line from the lock file to take the new one). A hub source that cannot be
resolved (no hub from this machine, no recorded commit) is refused before anything runs, with how
to pass a local copy instead.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Callable

from workflow_scripts.lib.common import UserError
from workflow_scripts.lib.workflow.sources import Source

COMMIT = re.compile(r"[0-9a-f]{40}")
HUB_TIMEOUT_S = 10.0
OFFLINE_ENV = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")


def lock_key(source: Source) -> str:
    return f"{source.hub}|{source.subset or ''}|{source.revision or 'main'}"


def hub_commit(name: str, revision: str) -> str:
    """The commit ``revision`` of hub dataset ``name`` is at now (needs the hub)."""
    if any(os.environ.get(v, "").strip().lower() in ("1", "true", "yes") for v in OFFLINE_ENV):
        raise ConnectionError(f"{' / '.join(OFFLINE_ENV)} is set")
    from huggingface_hub import HfApi

    return HfApi().dataset_info(name, revision=revision, timeout=HUB_TIMEOUT_S).sha


def pin(
    sources: list[Source],
    lock_path: Path,
    key: str,
    resolve: Callable[[str, str], str] = hub_commit,
) -> tuple[list[Source], list[str]]:
    """``sources`` with every hub revision a commit, and the warnings to show (a moved branch).
    Records new resolutions in ``lock_path``; ``key`` is the config key named in errors."""
    lock = json.loads(lock_path.read_text()) if lock_path.is_file() else {}
    pinned, warnings, changed = [], [], False
    for i, source in enumerate(sources):
        if source.hub is None or (source.revision and COMMIT.fullmatch(source.revision)):
            pinned.append(source)
            continue
        name, revision = lock_key(source), source.revision or "main"
        recorded = lock.get(name)
        try:
            now = resolve(source.hub, revision)
        except Exception as exc:  # no hub from here: the recorded commit, or a clear refusal
            if recorded is None:
                raise UserError(
                    f"config key '{key}[{i}]': hub dataset {source.hub} (revision {revision}) "
                    f"cannot be resolved to a commit: the hub is not reachable from this "
                    f"machine ({type(exc).__name__}: {exc}). Save it where this machine reads "
                    f"it (on a machine with the hub: datasets.load_dataset('{source.hub}'"
                    f"{', ' + repr(source.subset) if source.subset else ''}, split="
                    f"'{source.split}').save_to_disk(DIR), or its Parquet files) and name it "
                    f"with 'path: DIR' instead of 'hub'"
                ) from None
            now = None
        if recorded is None:
            lock[name], changed = now, True
            recorded = now
        elif now is not None and now != recorded:
            warnings.append(
                f"hub dataset {source.hub} (revision {revision}) has moved to commit {now} since "
                f"it was recorded; this run keeps {recorded} (delete its line in {lock_path} to "
                "take the new one)"
            )
        pinned.append(source.model_copy(update={"revision": recorded}))
    if changed:
        lock_path.parent.mkdir(parents=True, exist_ok=True)
        lock_path.write_text(json.dumps(lock, indent=2, sort_keys=True) + "\n")
    return pinned, warnings
