"""Extraction throughput against plain prefill, and bytes written per token against the floor.

    python benchmarks/bench_extract.py [VERIFIER_DIR] [--tokenized FILE] [--samples N]

In one run, on the same samples and with the same engine settings (config.yaml's extract
section, overridable with --set KEY=VALUE):

1. a plain vLLM engine prefills every sample (max_tokens=1, no extraction);
2. an extraction engine (extract_hidden_states + the project's connector) runs the same samples
   through the stage's own driver loop and writes real shards, checksums included.

Each is timed over ``--passes`` passes after a warm-up, best pass kept (other jobs may share the
machine). Prints tokens/s of both and their ratio (target >= 0.8), and the shard bytes per token
against the floor, (aux layers + 1) x hidden x dtype bytes (target within 2%; the token ids,
loss mask, offsets and header of each shard count as overhead).

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
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from workflow_scripts.lib import engine  # noqa: E402
from workflow_scripts.lib import extraction_engines as backends  # noqa: E402
from workflow_scripts.lib.config import load_config  # noqa: E402
from workflow_scripts.lib.definitions import ExtractParams  # noqa: E402
from workflow_scripts.lib.manifest import shard_name  # noqa: E402
from workflow_scripts.lib.shards import TORCH_DTYPES  # noqa: E402
from workflow_scripts.lib.verifier import aux_layer_ids, verifier_config  # noqa: E402


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


def timed_passes(run, passes: int, what: str) -> float:
    """Seconds of the best of ``passes`` runs (each pass printed)."""
    times = []
    for _ in range(passes):
        start = time.monotonic()
        run()
        times.append(time.monotonic() - start)
    print(f"{what} passes (s): {' '.join(f'{t:.2f}' for t in times)}", flush=True)
    return min(times)


def main() -> None:
    args = parse_args()
    raw = yaml.safe_load(args.config.read_text()) or {}
    extract_cfg = dict(raw.get("extract") or {})
    for item in args.set:
        key, _, value = item.partition("=")
        extract_cfg[key] = yaml.safe_load(value)
    p: ExtractParams = load_config({**raw, "extract": extract_cfg}).extract
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
        prefill_s = timed_passes(lambda: prefill(samples), args.passes, "prefill")
    finally:
        engine.close_llm(llm)

    # 2. extraction into real shards
    work = Path(tempfile.mkdtemp(prefix="bench_extract_"))
    scratch = work / "requests"
    scratch.mkdir()
    written = {"bytes": 0, "tokens": 0}
    kwargs = backends.vllm_engine_args(args.verifier, p, dtype_name, aux + [n_layers], scratch)
    llm = engine.make_llm(kwargs, p.use_gpus, in_process)
    try:

        def extraction(batch):
            out = work / "shards"
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir()
            written.update(bytes=0, tokens=0)

            finisher = backends.Finisher()  # as the stage does: fsync, rename, checksum
            backends.run_vllm(
                llm,
                shard_jobs(
                    batch, p.shard_size_samples, out, {"fingerprint": "bench", "sample_start": "0"}
                ),
                extract=True,
                num_aux=len(aux),
                hidden_size=hidden,
                dtype=dtype,
                on_shard=lambda job: finisher.submit(job.writer.finish),
                **loop,
            )
            for entry in finisher.wait():
                written["bytes"] += entry["bytes"]
                written["tokens"] += entry["num_tokens"]
            finisher.close()

        extraction(warm)
        extract_s = timed_passes(lambda: extraction(samples), args.passes, "extraction")
    finally:
        engine.close_llm(llm)
        shutil.rmtree(work, ignore_errors=True)

    floor = (len(aux) + 1) * hidden * dtype.itemsize
    per_token = written["bytes"] / written["tokens"]
    result = {
        "verifier": str(args.verifier),
        "samples": len(samples),
        "tokens": tokens,
        "engine_in_process": in_process,
        "prefill_tokens_per_s": tokens / prefill_s,
        "extract_tokens_per_s": tokens / extract_s,
        "throughput_ratio": prefill_s / extract_s,
        "bytes_per_token": per_token,
        "floor_bytes_per_token": floor,
        "bytes_ratio": per_token / floor,
    }
    print(f"plain prefill : {result['prefill_tokens_per_s']:10.0f} tokens/s ({prefill_s:.2f} s)")
    print(f"extraction    : {result['extract_tokens_per_s']:10.0f} tokens/s ({extract_s:.2f} s)")
    print(
        f"throughput ratio extraction / prefill: {result['throughput_ratio']:.3f} (target >= 0.8)"
    )
    print(
        f"bytes per token: {per_token:.1f} written, floor {floor} ((aux {len(aux)} + 1) x {hidden} x "
        f"{dtype.itemsize}); ratio {result['bytes_ratio']:.4f} (target <= 1.02)"
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
