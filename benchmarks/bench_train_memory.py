"""One training step of a draft shaped like a large verifier's draft, at growing micro-batch sizes
and TTT steps, with the TTT attention linear in the steps against the dense reference, side by
side in one run: peak memory and seconds of each, and the ratios that matter.

    .venv/bin/python benchmarks/bench_train_memory.py                     # CPU, width scaled down
    .venv/bin/python benchmarks/bench_train_memory.py --tokens 1024 2048 --steps 1 7
    python benchmarks/bench_train_memory.py --device cuda --full-width --dtype bfloat16

A step is forward (TTT unroll, the loss against the verifier's head over the draft vocabulary),
backward and an AdamW update, on one sample of N tokens, every position counted. Each case runs
in a fresh process: its peak memory is the process's peak resident memory (CPU) or peak
allocated GPU memory, minus what the process held before the step (model, inputs, optimizer
state, after a small warm-up step), so the figures are the step's own. The large draft is hidden 4096, 32 heads, 8 key/value heads of 128,
MLP 14336, draft vocabulary 32k; on the CPU the width is scaled down by 8 (hidden 512, 4 heads, 1
key/value head of 128, MLP 1792) with the same head size and draft vocabulary, so that a step at
8k tokens takes minutes, not hours. Printed:

* seconds and peak memory per case;
* the exponent of peak memory against N, fitted (log-log) over the sizes run, per attention;
* the 7-step / 1-step time ratio per N (linear in the steps: about 7 or less; the dense
  attention's grows with the square of the steps);
* the new/old speed ratio at the most steps run, per N;
* with --project N, per TTT step count, a step's peak memory fitted as a + b N over the sizes
  run (linear attention) and projected to one sample of N tokens, beside the same fit of what the
  forward saves for the backward (counted exactly, tensor by tensor: on the CPU the resident
  memory is coarse) and the weights, gradients and optimizer state;
* the loss computed without chunks (the whole step's [N, vocabulary] logits at once) against
  the chunked loss, at the most steps: the memory the chunking saves.
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LARGE = dict(hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=14336)
SCALED = dict(hidden=512, heads=4, kv_heads=1, head_dim=128, intermediate=1792)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    ap.add_argument("--steps", type=int, nargs="+", default=[1, 3, 7])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--full-width", action="store_true", help="hidden 4096 (default on cuda)")
    ap.add_argument(
        "--hidden",
        type=int,
        help="another verifier's draft: this hidden size, heads of 128, 8 key/value heads, MLP "
        "3.5x (8192: a 70B verifier's; 7168: Kimi-K2's as a Llama layer)",
    )
    ap.add_argument("--draft-vocab", type=int, default=32000)
    ap.add_argument("--no-dense", action="store_true", help="skip the dense reference")
    ap.add_argument(
        "--project",
        type=int,
        metavar="TOKENS",
        help="also project each case's peak memory to one sample of this many tokens "
        "(a + b N fitted over the sizes run; linear attention)",
    )
    ap.add_argument("--child", help=argparse.SUPPRESS)  # one case, as JSON
    return ap.parse_args(argv)


# --------------------------------------------------------------------------- one case


def peak_bytes(device: str) -> int:
    import torch

    if device == "cuda":
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_case(case: dict) -> dict:
    import torch

    from workflow_scripts.lib.draft import model as draft_model
    from workflow_scripts.lib.draft.layer_config import llama_layer_config
    from workflow_scripts.lib.draft.model import DraftConfig, Eagle3Draft, TeacherHead

    torch.manual_seed(0)
    device, n, steps, shape = case["device"], case["tokens"], case["steps"], case["shape"]
    if not case["chunked_loss"]:
        draft_model.LOSS_CHUNK_ELEMENTS = 1 << 62
    H, K = shape["hidden"], case["draft_vocab"]
    layer = llama_layer_config(
        dict(
            hidden_size=H,
            intermediate_size=shape["intermediate"],
            num_attention_heads=shape["heads"],
            num_key_value_heads=shape["kv_heads"],
            head_dim=shape["head_dim"],
            vocab_size=K,
            rms_norm_eps=1e-5,
            max_position_embeddings=max(16384, n),
            rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        )
    )
    model = Eagle3Draft(DraftConfig.from_layer_config(layer, draft_vocab_size=K)).to(device)
    model.layers[0].self_attn.dense = case["attention"] == "dense"
    teacher = TeacherHead(torch.ones(H), torch.randn(K, H) * 0.02, 1e-5).to(device)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    aux = torch.randn(1, n, 3, H, device=device)
    final = torch.randn(1, n, H, device=device)
    ids = torch.randint(0, K, (1, n), device=device)
    mask = torch.ones(1, n, dtype=torch.bool, device=device)
    autocast = (
        torch.autocast(device, dtype=torch.bfloat16)
        if case["dtype"] == "bfloat16"
        else torch.autocast(device, enabled=False)
    )

    held_storages = {t.untyped_storage().data_ptr() for t in [*model.parameters(), aux, final]}
    saved: dict[int, int] = {}  # storage -> bytes, of what the forward keeps for the backward

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in held_storages:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    def step(tokens: int, ttt_steps: int) -> None:
        saved.clear()
        with autocast, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss, _ = model(
                aux[:, :tokens], final[:, :tokens], ids[:, :tokens], mask[:, :tokens], teacher,
                ttt_steps,
            )  # fmt: skip
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step(64, 1)  # warm-up: kernels, the optimizer's state; small enough not to set the peak
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    before = peak_bytes(device) if device == "cuda" else current_rss()
    start = time.perf_counter()
    step(n, steps)
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    # held: what the process held before the step (weights, gradients' buffers, optimizer state;
    # on the CPU also the interpreter and libraries)
    return {
        **case,
        "seconds": seconds,
        "peak_bytes": peak_bytes(device) - before,
        "held": before,
        "saved_bytes": sum(saved.values()),
        "state_bytes": state_bytes(model, teacher, optimizer),
    }


def state_bytes(*holders) -> int:
    """Bytes of the weights (trained and frozen), their gradients and the optimizer's state."""
    import torch

    tensors = {}
    for h in holders:
        if isinstance(h, torch.optim.Optimizer):
            found = [t for st in h.state.values() for t in st.values() if torch.is_tensor(t)]
        else:
            found = [t for p in h.parameters() for t in (p, p.grad) if t is not None]
            found += list(h.buffers())
        tensors.update(
            {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in found}
        )
    return sum(tensors.values())


def current_rss() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * resource.getpagesize()


# --------------------------------------------------------------------------- the table


def child(case: dict) -> dict:
    proc = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(case)],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        return {**case, "error": proc.stderr.strip().splitlines()[-1][:120]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def slope(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of log(y) against log(x)."""
    points = [(math.log(x), math.log(y)) for x, y in points if y > 0]
    if len(points) < 2:
        return None
    mx = sum(x for x, _ in points) / len(points)
    my = sum(y for _, y in points) / len(points)
    sxx = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / sxx


def linear_fit(points: list[tuple[float, float]]) -> tuple[float, float] | None:
    """Least-squares (a, b) of y = a + b x."""
    if len({x for x, _ in points}) < 2:
        return None
    mx = sum(x for x, _ in points) / len(points)
    my = sum(y for _, y in points) / len(points)
    b = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    return my - b * mx, b


def main() -> None:
    args = parse_args()
    if args.child:
        print(json.dumps(run_case(json.loads(args.child))))
        return
    full = args.full_width or args.device == "cuda" or args.hidden is not None
    shape = LARGE if full else SCALED
    if args.hidden is not None:
        H = args.hidden
        shape = dict(hidden=H, heads=H // 128, kv_heads=8, head_dim=128, intermediate=7 * H // 2)
    print(
        f"draft: hidden {shape['hidden']}, {shape['heads']} heads, {shape['kv_heads']} key/value "
        f"heads of {shape['head_dim']}, MLP {shape['intermediate']}, draft vocabulary "
        f"{args.draft_vocab}{'' if full else ' (the width of hidden 4096 / 32 heads scaled by 1/8)'}"
        f"; {args.device}, {args.dtype}; one step: forward, backward, AdamW",
        flush=True,
    )
    attentions = ["linear"] + ([] if args.no_dense else ["dense"])
    most = max(args.steps)
    results: dict[tuple, dict] = {}
    base = dict(device=args.device, dtype=args.dtype, shape=shape, draft_vocab=args.draft_vocab)
    print(
        f"{'tokens':>7} {'steps':>5} {'attention':>9} {'loss':>9} {'seconds':>9} {'peak MiB':>9} "
        f"{'saved MiB':>9}"
    )
    cases = [(n, s, a, True) for n in args.tokens for s in args.steps for a in attentions] + [
        (n, most, "linear", False) for n in args.tokens
    ]
    for n, steps, attention, chunked in cases:
        case = {
            **base,
            "tokens": n,
            "steps": steps,
            "attention": attention,
            "chunked_loss": chunked,
        }
        r = child(case)
        results[(n, steps, attention, chunked)] = r
        shown = (
            f"{r['error']}"
            if "error" in r
            else f"{r['seconds']:9.1f} {r['peak_bytes'] / 2**20:9.0f} {r['saved_bytes'] / 2**20:9.0f}"
        )
        loss = "chunked" if chunked else "whole"
        print(f"{n:7d} {steps:5d} {attention:>9} {loss:>9} {shown}", flush=True)

    def ok(key):
        r = results.get(key)
        return r if r and "error" not in r else None

    print()
    for attention in attentions:
        for steps in args.steps:
            pts = [
                (n, r["peak_bytes"]) for n in args.tokens if (r := ok((n, steps, attention, True)))
            ]
            e = slope(pts)
            if e is not None:
                print(f"peak memory ~ N^{e:.2f}  ({attention} attention, {steps} TTT steps)")
    for steps in args.steps if args.project else []:
        runs = [r for n in args.tokens if (r := ok((n, steps, "linear", True)))]
        peak = linear_fit([(r["tokens"], r["peak_bytes"]) for r in runs])
        saved = linear_fit([(r["tokens"], r["saved_bytes"]) for r in runs])
        if peak and saved:
            gib, n = 2**30, args.project
            state = max(r["state_bytes"] for r in runs)
            step = peak[0] + peak[1] * n
            print(
                f"{steps} TTT steps: a step's own peak {peak[0] / gib:.2f} GiB + "
                f"{peak[1] / 2**20:.3f} MiB a token, of which saved for the backward "
                f"{saved[0] / gib:.2f} GiB + {saved[1] / 2**20:.3f} MiB a token (exact: the "
                f"tensors autograd keeps); at {n} tokens {step / gib:.1f} GiB (saved "
                f"{(saved[0] + saved[1] * n) / gib:.1f} GiB); with the weights, their gradients "
                f"and the optimizer's state ({state / gib:.1f} GiB) {(state + step) / gib:.1f} GiB"
            )
    lo, hi = min(args.steps), most
    for n in args.tokens:
        parts = []
        for attention in attentions:
            a, b = ok((n, hi, attention, True)), ok((n, lo, attention, True))
            if a and b:
                parts.append(f"{attention} {a['seconds'] / b['seconds']:.1f}")
        new, old = ok((n, hi, "linear", True)), ok((n, hi, "dense", True))
        speed = (
            f"; new/old speed at {hi} steps {old['seconds'] / new['seconds']:.2f}"
            if new and old
            else ""
        )
        whole = ok((n, hi, "linear", False))
        saved = (
            f"; whole-step loss {whole['peak_bytes'] / 2**20:.0f} MiB vs chunked "
            f"{new['peak_bytes'] / 2**20:.0f} MiB"
            if whole and new
            else ""
        )
        print(f"N={n}: time {hi} steps / {lo} step: {', '.join(parts)}{speed}{saved}")


if __name__ == "__main__":
    main()
