"""The rows of a source, streamed in a fixed order, each with where it is: ``file:row`` for a
path source (the line of a JSON Lines file, the item of a JSON array, the row of a Parquet file or
a saved dataset, counted from 1), ``owner/name/split:row`` for a hub dataset. A row that cannot be
read (not UTF-8, not JSON) comes as a ``BadRow`` in its place, for the stage that reads it to
count or report; nothing is dropped here. A file that cannot be read whole (a compressed file or
a Parquet file cut short, corrupt, or not the format its name says; a JSON array that does not
close) is a ``UserError`` naming it, never read as shorter data.

datasets, pyarrow and zstandard are imported only by the readers that need them.
"""

from __future__ import annotations

import functools
import gzip
import json
from pathlib import Path
from typing import Any, Iterator

from workflow_scripts.lib.common import UserError
from workflow_scripts.lib.data.files import file_kind, is_saved_dataset
from workflow_scripts.lib.data.lines import BadRow, parse_line
from workflow_scripts.lib.workflow.sources import Source

PARQUET_BATCH_ROWS = 1024
CHUNK_BYTES = 1 << 20


def _cut_short(path: Path, kind: str) -> UserError:
    return UserError(
        f"{path}: the {kind} file is cut short (it ends inside its compressed data): the copy "
        "or download did not finish. Copy it again whole"
    )


def _corrupt(path: Path, kind: str, exc: Exception) -> UserError:
    return UserError(
        f"{path}: corrupt, or not a {kind} file as its name says ({type(exc).__name__}: {exc}). "
        "Copy it again whole, or rename it to what it is"
    )


def _zstd_chunks(path: Path) -> Iterator[bytes]:
    """The decompressed bytes of a .zst file of one frame or several; a last frame that does not
    end (the file cut short) is an error, where zstandard's stream reader just stops."""
    import zstandard

    dctx = zstandard.ZstdDecompressor()
    with open(path, "rb") as fh:
        frame, fed = dctx.decompressobj(), False
        while chunk := fh.read(CHUNK_BYTES):
            while chunk:
                fed = True
                try:
                    yield frame.decompress(chunk)
                except zstandard.ZstdError as exc:
                    raise _corrupt(path, "zstd (.zst)", exc) from None
                if not frame.eof:
                    break
                chunk, frame, fed = frame.unused_data, dctx.decompressobj(), False
    if fed and not frame.eof:
        raise _cut_short(path, "zstd (.zst)")


def _gzip_chunks(path: Path) -> Iterator[bytes]:
    import zlib

    with gzip.open(path, "rb") as fh:
        while True:
            try:
                chunk = fh.read(CHUNK_BYTES)
            except EOFError:
                raise _cut_short(path, "gzip (.gz)") from None
            except (OSError, zlib.error) as exc:  # gzip.BadGzipFile is an OSError
                raise _corrupt(path, "gzip (.gz)", exc) from None
            if not chunk:
                return
            yield chunk


def _jsonl_lines(path: Path, kind: str) -> Iterator[bytes]:
    """The lines of a JSON Lines file, decompressed (.gz, .zst) where its name says so."""
    if kind == "jsonl.gz":
        chunks = _gzip_chunks(path)
    elif kind == "jsonl.zst":
        chunks = _zstd_chunks(path)
    else:
        with open(path, "rb") as fh:
            yield from fh
        return
    rest = b""
    for chunk in chunks:
        lines = (rest + chunk).split(b"\n")
        rest = lines.pop()
        yield from lines
    if rest:
        yield rest


def _parquet(path: Path):
    """The Parquet file at ``path``, its footer read; a file cut short (no footer) or not
    Parquet is an error naming it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as exc:
        raise _corrupt(path, "Parquet", exc) from None


@functools.lru_cache(maxsize=1)  # counted, its columns read, then its rows: read once
def _json_array(path: Path) -> list[Any]:
    try:
        with open(path, "rb") as fh:
            value = json.load(fh)
    except UnicodeDecodeError as exc:
        raise UserError(f"{path}: not a JSON array ({exc})") from None
    except json.JSONDecodeError as exc:
        if not exc.doc[exc.pos :].strip():
            raise UserError(
                f"{path}: the JSON array is cut short (the file ends before the array closes, "
                f"{exc.msg.lower()}): the copy or download did not finish. Copy it again whole"
            ) from None
        raise UserError(f"{path}: not a JSON array ({exc})") from None
    if not isinstance(value, list):
        raise UserError(
            f"{path}: a .json source must hold an array of rows, not {type(value).__name__} "
            "(JSON Lines files end in .jsonl)"
        )
    return value


def _saved(path: Path, split: str):
    from datasets import DatasetDict, load_from_disk

    data = load_from_disk(str(path))
    if isinstance(data, DatasetDict):
        if split not in data:
            raise UserError(
                f"{path}: the saved dataset has no split '{split}' (it has "
                f"{', '.join(data)}): set the source's 'split'"
            )
        data = data[split]
    return data


def hub_dataset(source: Source):
    """The hub dataset of ``source`` at its (resolved) revision, loaded with datasets."""
    return _hub(source.hub, source.subset, source.split, source.revision)


@functools.lru_cache(maxsize=2)  # counted, its columns read, then its rows: loaded once
def _hub(name: str, subset: str | None, split: str, revision: str | None):
    from datasets import load_dataset

    try:
        return load_dataset(name, subset, split=split, revision=revision)
    except Exception as exc:  # datasets raises many kinds; say which source and how to go on
        raise UserError(
            f"hub dataset {name} (subset {subset}, split {split}, revision {revision}) could not "
            f"be loaded: {type(exc).__name__}: {exc}. Without the hub, save it where the machine "
            "can read it (datasets' save_to_disk, or its Parquet files) and name that 'path' "
            "instead"
        ) from None


def dataset(source: Source):
    """The source as a table datasets reads (a hub dataset, a save_to_disk directory), else
    None (files read one by one)."""
    if source.hub is not None:
        return hub_dataset(source)
    if is_saved_dataset(Path(source.path)):
        return _saved(Path(source.path), source.split)
    return None


def file_rows(path: Path) -> Iterator[tuple[int, Any]]:
    """(row number from 1, the row or a BadRow) of one file, streamed."""
    kind = file_kind(path)
    if kind == "json":
        for n, row in enumerate(_json_array(path), start=1):
            yield n, row
    elif kind == "parquet":
        import pyarrow as pa

        n, batches = 0, _parquet(path).iter_batches(batch_size=PARQUET_BATCH_ROWS)
        while True:
            try:
                batch = next(batches, None)
            except (pa.ArrowException, OSError) as exc:
                raise _corrupt(path, "Parquet", exc) from None
            if batch is None:
                return
            for row in batch.to_pylist():
                n += 1
                yield n, row
    else:
        for n, line in enumerate(_jsonl_lines(path, kind), start=1):
            if not line.strip():
                continue
            try:
                yield n, parse_line(line)
            except BadRow as bad:
                yield n, bad


def iter_rows(source: Source, files: list[Path]) -> Iterator[tuple[str, Any]]:
    """(where, row or BadRow) of every row of ``source`` (``files``: its path's files)."""
    table = dataset(source)
    if table is not None:
        where = f"{source.hub}/{source.split}" if source.hub is not None else source.path
        for n, row in enumerate(table, start=1):
            yield f"{where}:{n}", row
        return
    for path in files:
        for n, row in file_rows(path):
            yield f"{path}:{n}", row


def count_rows(source: Source, files: list[Path]) -> int:
    """How many rows ``source`` has (a JSON Lines file is read once; Parquet from its footer)."""
    table = dataset(source)
    if table is not None:
        return len(table)
    total = 0
    for path in files:
        kind = file_kind(path)
        if kind == "parquet":
            total += _parquet(path).metadata.num_rows
        elif kind == "json":
            total += len(_json_array(path))
        else:
            total += sum(1 for line in _jsonl_lines(path, kind) if line.strip())
    return total


def columns(source: Source, files: list[Path]) -> list[str]:
    """The source's columns: a table's schema, or the keys of its first row that is an object."""
    table = dataset(source)
    if table is not None:
        return list(table.column_names)
    if file_kind(files[0]) == "parquet":
        return list(_parquet(files[0]).schema_arrow.names)
    for _, row in iter_rows(source, files):
        if isinstance(row, dict):
            return list(row)
    return []
