"""The records extraction writes and training reads, typed once: a job's part, the merged
manifest and, within a disk budget, the stream plan. Each is a shared header (what the shards are
states of, and what made them) and its own fields. The field order is the files' key order, so a
record written through its model has the bytes it had as a dict.

    manifest = Manifest.load(path)      # checked against this format, shard paths absolute
    manifest.check_against(vcfg, verifier_dir, where)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from workflow_scripts.lib.common import UserError
from workflow_scripts.lib.hidden_states.shard_format import FORMAT_VERSION, LAYER_CONVENTION
from workflow_scripts.lib.verifier import files as verifier_files
from workflow_scripts.lib.workflow.records import MadeBy, Record

DTYPES = ("float32", "bfloat16", "float16")
# shards.TORCH_DTYPES' names (no torch here: the merge job starts fast)
STORAGE_DTYPES = ("float32", "bfloat16", "float16", "float8_e4m3fn")


class VerifierRef(Record):
    path: str
    architectures: list[str] | None
    config_sha256: str
    weights: list[tuple[str, int]]
    tokenizer_sha256: dict[str, str]
    fingerprint: str


class TokenizedRef(Record):
    path: str
    sha256: str
    num_samples: int


class Header(Record):
    """What every record of extraction shares: the states' layout and what they were computed
    from and by."""

    format_version: Literal[FORMAT_VERSION]
    made_by: MadeBy
    layer_convention: str
    aux_layer_ids: list[int]
    final_layer_id: int
    hidden_size: int
    num_hidden_layers: int
    vocab_size: int
    dtype: Literal[DTYPES]
    storage_dtype: str
    backend: str
    verifier: VerifierRef
    tokenized: TokenizedRef
    shard_size_samples: int
    num_shards: int
    max_model_len_tokens: int
    on_too_long: str

    def check_against(self, vcfg: dict[str, Any], verifier_dir: Path, where: Path) -> None:
        """The states fit the verifier ``verifier_dir`` (its config.json ``vcfg``) and are its
        own: layers, sizes and identity; a UserError naming ``where`` (this record's file)."""
        H, N, V = int(vcfg["hidden_size"]), int(vcfg["num_hidden_layers"]), int(vcfg["vocab_size"])
        hint = "re-run extraction for this verifier"
        if self.layer_convention != LAYER_CONVENTION:
            raise UserError(
                f"{where}: layer_convention {self.layer_convention!r} is not the one this "
                f"workflow uses ({LAYER_CONVENTION!r}); {hint}"
            )
        if self.hidden_size != H:
            raise UserError(
                f"{where}: hidden_size {self.hidden_size} does not match the verifier "
                f"{verifier_dir} (hidden_size {H}); {hint}"
            )
        if self.num_hidden_layers != N:
            raise UserError(
                f"{where}: num_hidden_layers {self.num_hidden_layers} does not match the "
                f"verifier {verifier_dir} ({N} layers); {hint}"
            )
        aux = self.aux_layer_ids
        if not aux or any(not 0 <= i < N for i in aux):
            raise UserError(
                f"{where}: aux_layer_ids {aux} do not fit the verifier {verifier_dir} with {N} "
                f"layers: ids must be in 0..{N - 1} (vLLM's convention: id k is the input of "
                f"decoder layer k; {N} is the final state, never an auxiliary one); {hint}"
            )
        if len(set(aux)) != len(aux):
            raise UserError(f"{where}: aux_layer_ids {aux} repeat a layer; {hint}")
        if self.final_layer_id != N:
            raise UserError(
                f"{where}: final_layer_id {self.final_layer_id} is not the verifier's last "
                f"layer output ({N}); {hint}"
            )
        if self.vocab_size != V:
            raise UserError(
                f"{where}: vocab_size {self.vocab_size} does not match the verifier "
                f"{verifier_dir} (vocab_size {V}); {hint}"
            )
        recorded, actual = self.verifier.fingerprint, verifier_files.fingerprint(verifier_dir)
        if recorded != actual:
            raise UserError(
                f"{where}: extracted from another verifier (identity {recorded[:12]}, "
                f"{verifier_dir} has {actual[:12]}: config.json, weight files or tokenizer "
                f"differ); {hint}"
            )
        if self.storage_dtype not in STORAGE_DTYPES:
            raise UserError(
                f"{where}: unknown storage_dtype {self.storage_dtype!r} (known: "
                f"{', '.join(STORAGE_DTYPES)})"
            )
        if not self.shards or not self.num_samples:
            raise UserError(f"{where}: no samples; was the tokenized data empty?")


class ShardRecord(Record):
    """A finished shard as its writer records it (``shard_writer.shard_entry``, and the
    positions of the teacher check), kept beside it (``<shard>.sha256.json``)."""

    file: str
    sample_start: int
    num_samples: int
    num_tokens: int
    num_loss_tokens: int
    bytes: int
    sha256: str
    teacher_check: dict[str, Any] | None = None
    path: str | None = Field(None, exclude=True)  # absolute, once loaded (never written)


class ShardEntry(ShardRecord):
    """A finished shard, as a part or the manifest lists it (``file`` relative to the record)."""

    index: int
    sample_end: int
    num_skipped: int
    fingerprint: str


class ExtractPart(Header):
    """One extract job's shards."""

    kind: Literal["extract_part"]
    job_index: int
    num_jobs: int
    shard_indices: list[int]
    disk: dict[str, Any] | None
    num_samples: int
    num_tokens: int
    num_skipped_too_long: int
    skipped_too_long: list[int]
    shards: list[ShardEntry]


class Manifest(Header):
    """Every shard of the extraction, merged from the parts (what training reads)."""

    num_samples: int
    num_tokens: int
    num_loss_tokens: int
    num_skipped_too_long: int
    skipped_too_long: list[int]
    bytes: int
    shards: list[ShardEntry]
    disk: dict[str, Any] | None = None


class PlannedShard(Record):
    """A shard of a disk budget's plan: its samples and exact bytes, not computed yet."""

    index: int
    file: str
    samples: list[int]
    lengths: list[int]
    final_rows: list[int]
    num_tokens: int
    bytes: int
    fingerprint: str


class StreamPlan(Header):
    """Within extract.disk_budget: every shard's plan (the extract_plan stage's output)."""

    kind: Literal["stream_plan"]
    key: dict[str, Any]
    num_samples: int
    num_tokens: int
    num_skipped_too_long: int
    skipped_too_long: list[int]
    bytes: int
    shards: list[PlannedShard]
