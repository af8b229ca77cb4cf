"""Small helpers every stage script uses: logging, user-facing errors, atomic outputs, progress."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

log = logging.getLogger("eagle3")


class UserError(Exception):
    """A problem the user fixes (bad input, bad config): printed without a traceback."""


def run_main(main: Callable[[], None]) -> None:
    """Run a stage's main with logging to stderr; user errors exit 2 with one clear message."""
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
        force=True,
    )
    try:
        main()
    except UserError as exc:
        log.error("%s", exc)
        sys.exit(2)


@contextlib.contextmanager
def atomic_path(path: Path | str) -> Iterator[Path]:
    """Yield a temporary sibling of ``path`` (a file or a directory the block creates); rename it
    to ``path`` only when the block succeeds, so a reader never sees a partial output."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        if tmp.is_dir() and path.is_dir():
            shutil.rmtree(path)
        os.replace(tmp, path)
    finally:
        if tmp.is_dir():
            shutil.rmtree(tmp)
        elif tmp.exists():
            tmp.unlink()


def write_json(path: Path | str, obj: Any) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")


def sha256_file(path: Path | str, chunk_bytes: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


def count_lines(path: Path | str) -> int:
    with open(path, "rb") as fh:
        return sum(chunk.count(b"\n") for chunk in iter(lambda: fh.read(1 << 22), b""))


class Progress:
    """Logs '<done>/<total> <unit> (x/s, y tokens/s), ETA' at most every ``interval_s`` seconds,
    and always on the first update so a log shows life within seconds."""

    def __init__(self, what: str, total: int | None, interval_s: float = 10.0, unit: str = "rows"):
        self.what, self.total, self.interval_s, self.unit = what, total, interval_s, unit
        self.done = 0
        self.tokens = 0
        self.start = time.monotonic()
        self.last = None

    def update(self, items: int, tokens: int = 0, force: bool = False) -> None:
        self.done += items
        self.tokens += tokens
        now = time.monotonic()
        if force or self.last is None or now - self.last >= self.interval_s:
            self.last = now
            self.log()

    def log(self) -> None:
        elapsed = max(time.monotonic() - self.start, 1e-9)
        rate = self.done / elapsed
        parts = [f"{self.what}: {self.done}"]
        if self.total:
            parts[0] += f"/{self.total} {self.unit} ({100 * self.done / self.total:.1f}%)"
        else:
            parts[0] += f" {self.unit}"
        parts.append(f"{rate:.1f} {self.unit}/s")
        if self.tokens:
            parts.append(f"{self.tokens / elapsed:.0f} tokens/s")
        if self.total and rate > 0:
            parts.append(f"ETA {format_seconds((self.total - self.done) / rate)}")
        parts.append(f"elapsed {format_seconds(elapsed)}")
        log.info(", ".join(parts))


def format_seconds(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


def read_json(path: Path | str) -> Any:
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise UserError(f"{path}: file not found") from None
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}: not valid JSON ({exc})") from None


# What the nodes launcher (lib/workflow/nodes.py) tells a stage whose vLLM engine spans several
# nodes, and the engine's followers on the other nodes (lib/verifier/engine_nodes.py)
ENGINE_NODES_ENV = "EAGLE3_ENGINE_NODES"  # the engine's node count
ENGINE_HOSTS_ENV = (
    "EAGLE3_ENGINE_HOSTS"  # the job's SLURM node names, comma-separated, node 0 first
)
ENGINE_MASTER_ADDR_ENV = (
    "EAGLE3_ENGINE_MASTER_ADDR"  # node 0's address: the engine's ranks meet there
)
ENGINE_ARGS_ENV = "EAGLE3_ENGINE_ARGS"  # the file node 0 publishes its engine's arguments in
