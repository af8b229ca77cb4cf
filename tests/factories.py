"""Records for tests, built through the records the stages write (lib/hidden_states/records.py,
lib/workflow/records.py), so that a fixture is a record its readers accept because it is one,
not a subset they happen to check."""

from __future__ import annotations

from pathlib import Path

from workflow_scripts.lib.hidden_states import records, shards
from workflow_scripts.lib.hidden_states.shard_writer import shard_entry
from workflow_scripts.lib.verifier import files as verifier_files
from workflow_scripts.lib.workflow.code_inputs import made_by, shard_code_fingerprint
from workflow_scripts.lib.workflow.records import MetricsRow, PrepareStats


def shard_entries(paths: list[Path], directory: Path) -> list[records.ShardEntry]:
    """The manifest entries of finished shards (``file`` relative to ``directory``), read from
    the files as the extraction reads them."""
    entries = []
    for index, path in enumerate(paths):
        entry = shard_entry(path)
        entries.append(
            records.ShardEntry(
                **{**entry, "file": str(Path(path).relative_to(directory))},
                index=index,
                sample_end=entry["sample_start"] + entry["num_samples"],
                num_skipped=0,
                fingerprint=shards.shard_fingerprint(path) or "",
            )
        )
    return entries


def manifest(
    paths: list[Path],
    directory: Path,
    verifier_dir: Path,
    aux_ids: list[int],
    dtype: str = "float32",
    storage: str = "float32",
    shard_size: int = 16,
) -> records.Manifest:
    """The manifest of the shards ``paths`` (in ``directory``) of the verifier ``verifier_dir``."""
    vcfg = verifier_files.verifier_config(verifier_dir)
    entries = shard_entries(paths, directory)
    n = sum(e.num_samples for e in entries)
    return records.Manifest(
        format_version=records.FORMAT_VERSION,
        made_by=made_by("extract", code=shard_code_fingerprint()),
        layer_convention=records.LAYER_CONVENTION,
        aux_layer_ids=list(aux_ids),
        final_layer_id=int(vcfg["num_hidden_layers"]),
        hidden_size=int(vcfg["hidden_size"]),
        num_hidden_layers=int(vcfg["num_hidden_layers"]),
        vocab_size=int(vcfg["vocab_size"]),
        dtype=dtype,
        storage_dtype=storage,
        backend="vllm",
        verifier={
            "path": str(verifier_dir),
            "architectures": vcfg.get("architectures"),
            **verifier_files.identity(verifier_dir),
        },
        tokenized={"path": "tokenized_data.jsonl", "sha256": "0" * 64, "num_samples": n},
        shard_size_samples=shard_size,
        num_shards=len(entries),
        max_model_len_tokens=1 << 20,
        on_too_long="fail",
        num_samples=n,
        num_tokens=sum(e.num_tokens for e in entries),
        num_loss_tokens=sum(e.num_loss_tokens for e in entries),
        num_skipped_too_long=0,
        skipped_too_long=[],
        bytes=sum(e.bytes for e in entries),
        shards=entries,
    )


HEADER = dict(
    format_version=records.FORMAT_VERSION,
    made_by={"code": "c" * 64, "versions": {}},
    layer_convention=records.LAYER_CONVENTION,
    aux_layer_ids=[1, 2, 3],
    final_layer_id=4,
    hidden_size=64,
    num_hidden_layers=4,
    vocab_size=256,
    dtype="float32",
    storage_dtype="float32",
    backend="vllm",
    verifier={
        "path": "verifier",
        "architectures": ["LlamaForCausalLM"],
        "config_sha256": "0" * 64,
        "weights": [],
        "tokenizer_sha256": {},
        "fingerprint": "f" * 64,
    },
    tokenized={"path": "tokenized_data.jsonl", "sha256": "0" * 64, "num_samples": 0},
    shard_size_samples=16,
    num_shards=1,
    max_model_len_tokens=1024,
    on_too_long="fail",
)


def part(job_index: int = 0, num_jobs: int = 1, shards=(), **header) -> records.ExtractPart:
    """An extract job's part of no particular verifier (``header``: the fields that differ)."""
    shards = list(shards)
    return records.ExtractPart(
        **{**HEADER, **header},
        kind="extract_part",
        job_index=job_index,
        num_jobs=num_jobs,
        shard_indices=[e.index for e in shards] if shards else [job_index],
        disk=None,
        num_samples=sum(e.num_samples for e in shards),
        num_tokens=sum(e.num_tokens for e in shards),
        num_skipped_too_long=0,
        skipped_too_long=[],
        shards=shards,
    )


def stream_plan(shards: list[dict], key: dict, **header) -> records.StreamPlan:
    """A disk budget's plan of ``shards`` (planned shards, as dicts), of no particular verifier
    (``header``: the fields that differ); its totals summed from the shards."""
    return records.StreamPlan(
        **{**HEADER, "num_shards": len(shards), **header},
        kind="stream_plan",
        key=key,
        num_samples=sum(len(s["samples"]) for s in shards),
        num_tokens=sum(s["num_tokens"] for s in shards),
        num_skipped_too_long=0,
        skipped_too_long=[],
        bytes=sum(s["bytes"] for s in shards),
        shards=shards,
    )


def prepare_stats(**changes) -> PrepareStats:
    """prepare's statistics of 1 row of 100 tokens, 40 of them supervised (``changes`` replace
    any field)."""
    fields = dict(
        chat_data="chat_data.jsonl",
        verifier="verifier",
        rows_in=1,
        conversations_out=1,
        rows_out=1,
        rows_per_conversation={"1": 1},
        tokens=100,
        unique_tokens=100,
        extracted_over_unique=1.0,
        loss_masked_tokens=40,
        supervised_tokens_by_kind={"answer": 40},
        truncated_rows=0,
        reasoning_fields_disagree=0,
        conversations_by_source={},
        max_seq_len_tokens=4096,
        chat_template={},
        dropped={},
        made_by={"code": "c" * 64, "versions": {}},
    )
    return PrepareStats(**{**fields, **changes})


def metrics_row(
    step: int, split: str, acceptance_per_position: list[float], **changes
) -> MetricsRow:
    """A row of training's metrics: its step, split and acceptance per draft position (the
    simulated acceptance length from them), one TTT step's figures besides."""
    return MetricsRow(
        step=step,
        split=split,
        loss=1.0,
        kl_per_step=[1.0],
        top1_agreement=[0.5],
        top1_agreement_full_vocab=[0.5],
        acceptance_per_position=acceptance_per_position,
        simulated_acceptance_length=1 + sum(acceptance_per_position),
        positions_per_step=[100],
        **changes,
    )
