"""Where training's rows go: ``metrics.jsonl`` beside the resume state (every row; what a resumed
run continues and the stage's metrics output copies), and the backends ``train.report_to`` lists,
TensorBoard and Weights & Biases, written by the main process only.

A backend shows each row as scalars named ``<split>/<key>`` (``train/loss``, ``val/loss``,
``train/lr``, ...; a list, one value per TTT step or speculative position, as
``<split>/<key>/<1..>``) against the optimizer step. Their files are in the training's directory
(``<results_dir>/train``, the metrics file's), never among the state's:

    tensorboard/<run id>/    event files: tensorboard --logdir <results_dir>/train/tensorboard
    wandb/                   W&B's run directories (offline-run-<time>-<run id>, run-...)

A training run has one id, kept in its resume state (``trainer.py``); one started from scratch
gets a new one, and TensorBoard and W&B show it as a run of its own. A resumed run continues its
curves, each step once: every backend holds the steps up to some step (TensorBoard: the resumed
one, the later ones, logged before the kill, purged; W&B online: the server's, ``run.step``;
offline: those in the run's transaction logs, ``*.wandb``, which ``wandb sync`` uploads), is sent
the rows of metrics.jsonl after it, then the new ones.

W&B runs offline unless the user configured it (WANDB_MODE, WANDB_API_KEY, ``wandb login``).
Neither backend is imported unless listed; ``train.report_to`` refuses one that is not installed.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import struct
import time
from pathlib import Path
from typing import Any, Iterator

from workflow_scripts.lib.common import UserError, atomic_path
from workflow_scripts.lib.workflow.definitions import TrainParams
from workflow_scripts.lib.workflow.records import MetricsRow

log = logging.getLogger("eagle3")

TENSORBOARD, WANDB = "tensorboard", "wandb"


def new_run_id() -> str:
    """A training run's id: when it started and 4 random hex digits (W&B's run id, and the name
    of its TensorBoard directory)."""
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"


def read_rows(path: Path) -> list[MetricsRow]:
    return MetricsRow.read_all(path)


def keep_rows(path: Path, until: int) -> None:
    """Keep the metrics rows up to step ``until`` (none for -1): a killed run may have logged
    past the state it resumes from."""
    rows = read_rows(path) if until >= 0 else []
    with atomic_path(path) as tmp:
        tmp.write_text("".join(row.line() for row in rows if row.step <= until))


def append_row(path: Path, row: MetricsRow) -> None:
    with open(path, "a") as fh:
        fh.write(row.line())


def scalars(row: MetricsRow) -> dict[str, float]:
    """A metrics row as the backends' scalars (see the module's docstring)."""
    out = {}
    for key, value in row.model_dump(exclude_unset=True).items():
        name = f"{row.split}/{key}"
        if isinstance(value, list):
            out.update({f"{name}/{i}": float(v) for i, v in enumerate(value, 1)})
        elif isinstance(value, (int, float)) and key != "step":
            out[name] = float(value)
    return out


class TensorBoard:
    """The run's event files, ``<root>/tensorboard/<run id>``, flushed at every row: a killed
    run leaves every row it logged, and its resumed run purges those past the resumed step."""

    def __init__(self, root: Path, run_id: str, resumed: int):
        from torch.utils.tensorboard import SummaryWriter

        directory = root / TENSORBOARD / run_id
        existed = directory.is_dir()
        self.held = resumed if existed else 0
        self.writer = SummaryWriter(str(directory), purge_step=resumed + 1 if existed else None)
        log.info(
            "training curves: TensorBoard event files in %s (tensorboard --logdir %s)",
            directory,
            directory.parent,
        )

    def log(self, step: int, values: dict[str, float]) -> None:
        for name, value in values.items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def summary(self, values: dict[str, float]) -> None:
        """(TensorBoard has the selected validation among the validation curves.)"""

    def close(self, ok: bool) -> None:
        self.writer.close()


class WandB:
    """The run in Weights & Biases: id ``run_id``, resumed where it exists; its files in
    ``<root>/wandb``. Offline unless the user configured W&B: WANDB_MODE is W&B's to read, and a
    key (WANDB_API_KEY, ``wandb login``) makes it online."""

    def __init__(self, p: TrainParams, root: Path, run_id: str):
        import wandb

        configured = bool(os.environ.get("WANDB_MODE")) or wandb.login(prompt=False, verify=False)
        project = p.wandb_project or root.parent.name  # the results_dir's name
        try:
            self.run = wandb.init(
                project=project,
                name=p.wandb_run_name or run_id,
                id=run_id,
                resume="allow",
                dir=root,
                mode=None if configured else "offline",
                job_type="train",
                config=p.model_dump(mode="json"),
            )
        except Exception as exc:  # W&B's own (no server, a key it refuses, ...)
            raise UserError(
                f"train.report_to wandb: W&B did not start the run ({exc}); set WANDB_MODE="
                "offline to keep the run's files and upload them later (wandb sync), or remove "
                "wandb from train.report_to"
            ) from exc
        runs = root / WANDB
        if self.run.disabled:
            self.held = 0
            log.info("training curves: W&B disabled (WANDB_MODE=%s)", os.environ.get("WANDB_MODE"))
        elif self.run.offline:
            logs = runs.glob(f"offline-run-*-{run_id}/run-{run_id}.wandb")
            self.held = max((step for path in logs for step in logged_steps(path)), default=0)
            log.info(
                "training curves: W&B run %s (id %s, project %s) offline, its files in %s; "
                "upload it with: wandb sync %s (or set WANDB_API_KEY or run wandb login before "
                "training to report online)",
                self.run.name,
                run_id,
                project,
                self.run.settings.sync_dir,
                runs / f"offline-run-*-{run_id}",
            )
        else:
            self.held = self.run.step - 1
            log.info("training curves: W&B run %s online: %s", self.run.name, self.run.url)

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def summary(self, values: dict[str, float]) -> None:
        self.run.summary.update(values)

    def close(self, ok: bool) -> None:
        self.run.finish(exit_code=0 if ok else 1)


class Reporter:
    """The backends of ``train.report_to`` for one training run, sent the rows of metrics.jsonl
    that each lacks (``rows``: those a resumed run keeps), then every new one."""

    def __init__(
        self, p: TrainParams, root: Path, run_id: str, resumed: int, rows: list[MetricsRow]
    ):
        root.mkdir(parents=True, exist_ok=True)
        self.backends: list[TensorBoard | WandB] = []
        for name in p.report_to:
            if name == TENSORBOARD:
                self.backends.append(TensorBoard(root, run_id, resumed))
            else:
                self.backends.append(WandB(p, root, run_id))
        for row in rows:
            self.log(row)

    def log(self, row: MetricsRow) -> None:
        values = scalars(row)
        for backend in self.backends:
            if row.step > backend.held:
                backend.log(row.step, values)

    def summary(self, row: MetricsRow) -> None:
        """The validation whose weights the draft has (the ``selected`` row)."""
        for backend in self.backends:
            backend.summary(scalars(row))

    def close(self, ok: bool) -> None:
        for backend in self.backends:
            backend.close(ok)


# W&B's transaction log (run-<id>.wandb): a 7-byte header (":W&B", 0xBEE1, version), then
# LevelDB log blocks of 32 KiB; each record (wandb's protobuf Record) in chunks with a 7-byte
# header (checksum, length, type: 1 full, 2 first, 3 middle, 4 last); a block's tail shorter
# than a header is zeros. A killed process leaves whole blocks: its last record may be cut.
_BLOCK, _HEADER = 32 * 1024, 7
_FULL, _FIRST, _LAST = 1, 2, 4


def wandb_records(path: Path) -> Iterator[Any]:
    """The records (wandb's protobuf ``Record``) of a W&B transaction log, up to a cut."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    pos, record = _HEADER, b""
    while pos + _HEADER <= len(data):
        room = _BLOCK - pos % _BLOCK
        _, length, kind = struct.unpack_from("<IHB", data, pos)
        if room < _HEADER or kind == 0:  # padding: the next block
            pos += room
            continue
        if pos + _HEADER + length > len(data):  # cut by a kill
            return
        chunk = data[pos + _HEADER : pos + _HEADER + length]
        record = chunk if kind in (_FULL, _FIRST) else record + chunk
        pos += _HEADER + length
        if kind in (_FULL, _LAST):
            yield wandb_internal_pb2.Record.FromString(record)


def items(entries) -> dict[str, Any]:
    """History or summary entries of a record (``.history.item``, ``.summary.update``)."""
    return {e.key or "/".join(e.nested_key): json.loads(e.value_json) for e in entries}


def logged_steps(path: Path) -> list[int]:
    """The steps of the history rows in a W&B transaction log."""
    return [
        int(items(record.history.item)["_step"])
        for record in wandb_records(path)
        if record.HasField("history")
    ]
