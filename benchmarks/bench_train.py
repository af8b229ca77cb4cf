"""Training throughput: the real data path (memory-mapped shards, background loader) against the
same steps fed from tensors already in memory, in one run. Prints tokens/s of both and the ratio
(target >= 0.9: the data path costs under 10%).

    .venv/bin/python benchmarks/bench_train.py                 # the pipeline's outputs if built,
                                                               # else synthetic shards
    .venv/bin/python benchmarks/bench_train.py --synthetic     # demo-sized random shards
    .venv/bin/python benchmarks/bench_train.py --manifest M --vocab-map V --verifier DIR

The two feeds alternate in blocks of the same steps (same shapes, same tokens), so load from
other processes on the machine falls on both alike; the headline compares each feed's best
block (the least disturbed), the median is printed beside it.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from workflow_scripts.lib.hidden_states import (
    manifest,  # noqa: E402
    shards,  # noqa: E402
)
from workflow_scripts.lib.hidden_states.shard_writer import write_samples  # noqa: E402
from workflow_scripts.lib.training.loader import Loader  # noqa: E402
from workflow_scripts.lib.training.inputs import check_inputs  # noqa: E402
from workflow_scripts.lib.training.processes import setup_processes  # noqa: E402
from workflow_scripts.lib.training.trainer import Trainer  # noqa: E402
from tests import factories  # noqa: E402
from workflow_scripts.lib.workflow.definitions import TrainParams  # noqa: E402
from workflow_scripts.lib.workflow.registry import TrainIO  # noqa: E402
from workflow_scripts.lib.workflow.layout import MANIFEST, METRICS, Layout


def synthetic_inputs(root: Path, num_samples=1200, hidden=128, layers=8, vocab=1024, k=512):
    """Random shards shaped like the embedded default's (same hidden size, layer count, vocab,
    sample lengths around 100 tokens), a random verifier head and a vocab map."""
    g = torch.Generator().manual_seed(0)
    verifier = root / "verifier"
    verifier.mkdir(parents=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": 3 * hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": hidden // 2,
        "vocab_size": vocab,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 2048,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "tie_word_embeddings": False,
    }
    (verifier / "config.json").write_text(json.dumps(config))
    save_file(
        {
            "model.embed_tokens.weight": torch.randn(vocab, hidden, generator=g) * 0.02,
            "model.norm.weight": torch.ones(hidden),
            "lm_head.weight": torch.randn(vocab, hidden, generator=g) * 0.02,
        },
        str(verifier / "model.safetensors"),
    )
    aux_ids = [2, layers // 2, layers - 3]
    extract = root / "extract"
    extract.mkdir()
    paths, start = [], 0
    while start < num_samples:
        samples = []
        for _ in range(min(256, num_samples - start)):
            n = int(torch.randint(40, 200, (1,), generator=g))
            mask = torch.zeros(n, dtype=torch.uint8)
            mask[n // 2 :] = 1
            samples.append(
                shards.SampleStates(
                    torch.randn(n, 3, hidden, generator=g),
                    torch.randn(n, hidden, generator=g),
                    torch.randint(0, vocab, (n,), generator=g),
                    mask,
                )
            )
        path = extract / manifest.shard_name(len(paths))
        write_samples(path, samples, {"fingerprint": f"bench-{start}", "sample_start": str(start)})
        paths.append(path)
        start += len(samples)
    factories.manifest(paths, extract, verifier, aux_ids, shard_size=256).write(extract / MANIFEST)
    selected = torch.arange(k)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[selected] = True
    vocab_map = root / "vocab_map.safetensors"
    save_file({"d2t": selected - torch.arange(k), "t2d": t2d}, str(vocab_map))
    return extract / MANIFEST, vocab_map, verifier


def scratch_io(manifest: Path, vocab_map: Path, verifier: Path, root: Path) -> TrainIO:
    """Training's inputs, with its state, draft and metrics written under ``root`` (scratch)."""
    return TrainIO(
        manifest=manifest,
        engine_cmd="",
        vocab_map=vocab_map,
        verifier=verifier,
        state_dir=root / "state",
        draft=root / "draft",
        metrics=root / METRICS,
    )


def timed(trainer: Trainer, steps) -> tuple[int, float]:
    """Train on the StepData of ``steps`` (an iterable); tokens and seconds."""
    tokens, start = 0, time.perf_counter()
    for data in steps:
        trainer.train_step(data)
        tokens += sum(mb.num_tokens for mb in data.micro_batches)
    return tokens, time.perf_counter() - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--manifest", type=Path, default=Layout(ROOT / "results").extract.manifest)
    parser.add_argument(
        "--vocab-map", type=Path, default=ROOT / "results/vocab/vocab_map.safetensors"
    )
    parser.add_argument("--verifier", type=Path, default=ROOT / "results/demo/verifier")
    parser.add_argument("--synthetic", action="store_true", help="random demo-sized shards")
    parser.add_argument("--micro-batch-budget-tokens", type=int, default=4096)
    parser.add_argument("--ttt-steps", type=int, default=3)
    parser.add_argument("--steps-per-block", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=8, help="shard/memory block pairs")
    parser.add_argument("--warmup-steps", type=int, default=3)
    parser.add_argument(
        "--background",
        action="store_true",
        help="read on a background thread also on the CPU (training does so on GPUs only)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if args.synthetic or not args.manifest.exists():
            print("inputs: synthetic demo-sized shards", flush=True)
            manifest, vocab_map, verifier = synthetic_inputs(tmp / "inputs")
        else:
            manifest, vocab_map, verifier = args.manifest, args.vocab_map, args.verifier
            print(f"inputs: {manifest}", flush=True)
        io = scratch_io(manifest, vocab_map, verifier, tmp)
        p = TrainParams(
            micro_batch_budget_tokens=args.micro_batch_budget_tokens,
            ttt_steps=args.ttt_steps,
            epochs=20,  # only as many steps as measured are taken
            validation_fraction=0.0,
        )
        d = setup_processes(p)
        trainer = Trainer(io, p, check_inputs(io, p), d)
        index, plan = trainer.inputs.index, trainer.plan
        block = args.steps_per_block
        needed = args.warmup_steps + args.rounds * block
        if plan.total_steps < needed:
            raise SystemExit(f"only {plan.total_steps} steps of data; {needed} needed")

        def from_shards(first: int):
            return Loader(
                index, plan, first, first + block, 0, 1, torch.float32, False, args.background
            )

        def in_memory(first: int):
            return [from_shards(first).load(s) for s in range(first, first + block)]

        timed(trainer, in_memory(0)[: args.warmup_steps])
        results = {"shards": [], "memory": []}
        for r in range(args.rounds):
            first = args.warmup_steps + r * block
            preloaded = in_memory(first)  # the same steps, read before the clock starts
            order = ("shards", "memory") if r % 2 == 0 else ("memory", "shards")
            for mode in order:
                source = from_shards(first) if mode == "shards" else preloaded
                tokens, seconds = timed(trainer, source)
                results[mode].append(tokens / seconds)
                print(f"round {r + 1} {mode:>6}: {tokens / seconds:9.0f} tokens/s", flush=True)
        best = {mode: max(rates) for mode, rates in results.items()}
        median = {mode: statistics.median(rates) for mode, rates in results.items()}
        print(
            f"\ntraining tokens/s, best (median) of {args.rounds} blocks of {block} steps; "
            f"{plan.micro_per_step} micro-batch(es) of <= {p.micro_batch_budget_tokens} tokens, "
            f"{torch.get_num_threads()} compute thread(s):"
        )
        how = "a background thread" if args.background else "read when due"
        print(
            f"  from shards (memory-mapped, {how}): {best['shards']:.0f} ({median['shards']:.0f})"
        )
        print(f"  from tensors in memory: {best['memory']:.0f} ({median['memory']:.0f})")
        print(
            f"  ratio: {best['shards'] / best['memory']:.3f} "
            f"(median {median['shards'] / median['memory']:.3f}; target >= 0.9)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
