"""Extraction throughput against plain prefill, and bytes written per token against the floor.

    python benchmarks/bench_extract.py [VERIFIER_DIR] [--tokenized FILE] [--samples N]
        [--storage-dtype compute bfloat16 float8_e4m3fn]

In one run, on the same samples and with the same engine settings (config.yaml's extract
section, overridable with --set KEY=VALUE):

1. a plain vLLM engine prefills every sample (max_tokens=1, no extraction);
2. an extraction engine (extract_hidden_states + the project's connector) runs the same samples
   through the stage's own driver loop and writes real shards, checksums included, once per
   storage dtype of ``--storage-dtype`` (the passes of the dtypes interleaved, one engine).

Each is timed over ``--passes`` passes after a warm-up, best pass kept (other jobs may share the
machine). Prints tokens/s of each and its ratio to plain prefill (target >= 0.8; >= 0.9 for
float8 storage, whose encoding is extra work in the engine), and the shard bytes per token
against the compute dtype's floor, (aux layers + 1) x hidden x dtype bytes: stored as computed
within 2% (the token ids, loss mask, offsets and header of each shard count as overhead), as
float8 from float32 about 0.25 (plus a 4-byte scale per token and layer).

VERIFIER_DIR defaults to results/demo/verifier. Without --tokenized the samples are random token
ids with lengths drawn from [--min-tokens, --max-tokens].
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.workflow_run import with_settings  # noqa: E402
from workflow_scripts.lib.workflow.config import layered_files  # noqa: E402
from workflow_scripts.lib.hidden_states import extract_engines as backends  # noqa: E402
from workflow_scripts.lib.hidden_states.manifest import shard_name  # noqa: E402
from workflow_scripts.lib.hidden_states.shards import TORCH_DTYPES, storage_dtype_name  # noqa: E402
from workflow_scripts.lib.verifier import engine  # noqa: E402
from workflow_scripts.lib.verifier.files import aux_layer_ids, verifier_config  # noqa: E402
from workflow_scripts.lib.workflow.config import load_config  # noqa: E402
from workflow_scripts.lib.workflow.definitions import ExtractParams  # noqa: E402


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    default = ROOT / "results" / "demo" / "verifier"
    ap.add_argument("verifier", nargs="?", type=Path, default=default if default.exists() else None)
    ap.add_argument("--config", type=Path, default=ROOT / "config.yaml")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override an extract setting (value parsed as YAML), e.g. --set enforce_eager=true",
    )
    ap.add_argument("--tokenized", type=Path, help="tokenized_data.jsonl to take samples from")
    ap.add_argument("--samples", type=int, default=400)
    ap.add_argument("--min-tokens", type=int, default=100)
    ap.add_argument("--max-tokens", type=int, default=400)
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument(
        "--engine-process",
        choices=("auto", "in", "separate"),
        default="auto",
        help="engine core in this process or its own (auto: as the stage does)",
    )
    ap.add_argument(
        "--storage-dtype",
        nargs="+",
        default=["compute"],
        choices=("compute", "bfloat16", "float8_e4m3fn"),
        help="extract.storage_dtype values to extract with, side by side",
    )
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()
    if args.verifier is None:
        ap.error("give a verifier directory (results/demo/verifier does not exist yet)")
    return args


def load_samples(
    args, vocab_size: int, limit_tokens: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    samples = []
    if args.tokenized:
        with open(args.tokenized) as fh:
            for line in fh:
                row = json.loads(line)
                if len(row["input_ids"]) < limit_tokens:
                    samples.append((torch.tensor(row["input_ids"]), torch.tensor(row["loss_mask"])))
                if len(samples) == args.samples:
                    break
        return samples
    g = torch.Generator().manual_seed(0)
    hi = min(args.max_tokens, limit_tokens - 1)
    for _ in range(args.samples):
        n = int(torch.randint(args.min_tokens, hi + 1, (1,), generator=g))
        samples.append(
            (torch.randint(0, vocab_size, (n,), generator=g), torch.ones(n, dtype=torch.uint8))
        )
    return samples


def shard_jobs(samples, shard_size: int, out: Path, meta: dict):
    jobs = []
    for index, start in enumerate(range(0, len(samples), shard_size)):
        jobs.append(
            backends.ShardJob(
                index, out / shard_name(index), samples[start : start + shard_size], dict(meta)
            )
        )
    return jobs


def timed_passes(runs: dict, passes: int, reset=None) -> dict[str, float]:
    """Seconds of the best of ``passes`` runs of each of ``runs`` (name -> function), the runs
    interleaved pass by pass (each pass printed); ``reset``, where given, called before each
    run (not timed)."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(passes):
        for name, run in runs.items():
            if reset is not None:
                reset()
            start = time.monotonic()
            run()
            times[name].append(time.monotonic() - start)
    for name, ts in times.items():
        print(f"{name} passes (s): {' '.join(f'{t:.2f}' for t in ts)}", flush=True)
    return {name: min(ts) for name, ts in times.items()}


def main() -> None:
    args = parse_args()
    raw = with_settings(layered_files([args.config]), "extract", args.set)
    p: ExtractParams = load_config(raw).extract
    cfg = verifier_config(args.verifier)
    aux = aux_layer_ids(cfg, p.aux_layer_ids)
    n_layers, hidden = int(cfg["num_hidden_layers"]), int(cfg["hidden_size"])
    dtype_name = engine.resolve_dtype(p, cfg)
    dtype = TORCH_DTYPES[dtype_name]
    samples = load_samples(args, int(cfg["vocab_size"]), p.max_model_len_tokens)
    tokens = sum(int(ids.numel()) for ids, _ in samples)
    warm = samples[: min(16, len(samples))]
    in_process = (
        engine.core_in_process(p) if args.engine_process == "auto" else args.engine_process == "in"
    )
    loop = dict(batch_size_samples=p.batch_size_samples, batch_budget_tokens=p.batch_budget_tokens)
    print(
        f"verifier {args.verifier}: {n_layers} layers, hidden {hidden}, {dtype_name}; layers {aux} + "
        f"final {n_layers}; {len(samples)} samples, {tokens} tokens; engine core "
        f"{'in process' if in_process else 'in its own process'}",
        flush=True,
    )

    # 1. plain prefill
    llm = engine.make_llm(
        backends.vllm_engine_args(args.verifier, p, dtype_name, None, None), p.use_gpus, in_process
    )
    try:

        def prefill(batch):
            backends.run_vllm(
                llm,
                shard_jobs(batch, p.shard_size_samples, Path("/nonexistent"), {}),
                extract=False,
                **loop,
            )

        prefill(warm)
        prefill_s = timed_passes({"prefill": lambda: prefill(samples)}, args.passes)["prefill"]
    finally:
        engine.close_llm(llm)

    # 2. extraction into real shards, in each storage dtype
    work = Path(tempfile.mkdtemp(prefix="bench_extract_"))
    scratch = work / "requests"
    scratch.mkdir()
    storages = list(dict.fromkeys(storage_dtype_name(s, dtype_name) for s in args.storage_dtype))
    written = {name: {"bytes": 0, "tokens": 0} for name in storages}
    kwargs = backends.vllm_engine_args(args.verifier, p, dtype_name, aux + [n_layers], scratch)
    llm = engine.make_llm(kwargs, p.use_gpus, in_process)
    try:

        def extraction(batch, storage: str):
            out = work / "shards"
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir()
            written[storage].update(bytes=0, tokens=0)

            finisher = backends.Finisher()  # as the stage does: fsync, rename, checksum
            backends.run_vllm(
                llm,
                shard_jobs(
                    batch, p.shard_size_samples, out, {"fingerprint": "bench", "sample_start": "0"}
                ),
                extract=True,
                num_aux=len(aux),
                hidden_size=hidden,
                storage=TORCH_DTYPES[storage],
                on_shard=lambda job: finisher.submit(job.writer.finish),
                **loop,
            )
            for entry in finisher.wait():
                written[storage]["bytes"] += entry["bytes"]
                written[storage]["tokens"] += entry["num_tokens"]
            finisher.close()

        for storage in storages:
            extraction(warm, storage)
        extract_s = timed_passes(
            {s: (lambda s=s: extraction(samples, s)) for s in storages}, args.passes
        )
    finally:
        engine.close_llm(llm)
        shutil.rmtree(work, ignore_errors=True)

    floor = (len(aux) + 1) * hidden * dtype.itemsize
    result = {
        "verifier": str(args.verifier),
        "samples": len(samples),
        "tokens": tokens,
        "engine_in_process": in_process,
        "compute_dtype": dtype_name,
        "prefill_tokens_per_s": tokens / prefill_s,
        "floor_bytes_per_token": floor,
        "storage": {},
    }
    print(f"plain prefill : {tokens / prefill_s:10.0f} tokens/s ({prefill_s:.2f} s)")
    for storage in storages:
        per_token = written[storage]["bytes"] / written[storage]["tokens"]
        r = {
            "extract_tokens_per_s": tokens / extract_s[storage],
            "throughput_ratio": prefill_s / extract_s[storage],
            "bytes_per_token": per_token,
            "bytes_ratio": per_token / floor,
        }
        result["storage"][storage] = r
        print(
            f"extraction stored as {storage:13s}: {r['extract_tokens_per_s']:10.0f} tokens/s "
            f"({extract_s[storage]:.2f} s); extraction / prefill {r['throughput_ratio']:.3f}; "
            f"{per_token:.1f} bytes per token, {r['bytes_ratio']:.4f} of the {dtype_name} floor "
            f"{floor} ((aux {len(aux)} + 1) x {hidden} x {dtype.itemsize})"
        )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
