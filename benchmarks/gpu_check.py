"""Inputs for benchmarks/gpu_check.sh: a training stage's inputs shaped like a large verifier's
(hidden 4096, 32 heads, 8 key/value heads, vocabulary 128256, 32 layers; draft vocabulary 32000),
with samples of 8192 tokens, and the train command line that uses them.

    python benchmarks/gpu_check.py prepare DIR [--small]   # verifier head, shards, vocab map
    python benchmarks/gpu_check.py args DIR [--small]      # the train stage's arguments
    python benchmarks/gpu_check.py report LOG              # the figures from the train log
    python benchmarks/gpu_check.py fp8 [--small]           # float8 shard encoding on the device

Only the verifier's embedding, final norm and lm_head are written (all training reads). The
hidden states are random but learnable: the final state is a fixed mixture of the auxiliary
ones, so the loss falls within a few steps. ``--small`` scales everything down to check the
script on a CPU.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LARGE = dict(hidden=4096, heads=32, kv_heads=8, intermediate=14336, vocab=128256, layers=32)
SMALL = dict(hidden=256, heads=4, kv_heads=2, intermediate=512, vocab=4096, layers=8)
DRAFT_VOCAB = {"large": 32000, "small": 1024}
TOKENS = {"large": 8192, "small": 512}
SAMPLES = 8


def shape(small: bool) -> tuple[dict, int, int]:
    key = "small" if small else "large"
    return (SMALL if small else LARGE), DRAFT_VOCAB[key], TOKENS[key]


def prepare(out: Path, small: bool) -> None:
    import torch
    from safetensors.torch import save_file

    from workflow_scripts.lib.hidden_states import manifest, shards
    from workflow_scripts.lib.verifier import files as verifier_files

    s, draft_vocab, tokens = shape(small)
    H, V = s["hidden"], s["vocab"]
    g = torch.Generator().manual_seed(0)
    vdir = out / "verifier"
    vdir.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": H,
        "intermediate_size": s["intermediate"],
        "num_attention_heads": s["heads"],
        "num_key_value_heads": s["kv_heads"],
        "num_hidden_layers": s["layers"],
        "vocab_size": V,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 16384,
        "rope_theta": 500000.0,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
    }
    (vdir / "config.json").write_text(json.dumps(config, indent=2))
    head = {
        "model.embed_tokens.weight": torch.randn(V, H, generator=g) * 0.02,
        "model.norm.weight": torch.ones(H),
        "lm_head.weight": torch.randn(V, H, generator=g) * 0.02,
    }
    save_file({k: v.to(torch.bfloat16) for k, v in head.items()}, str(vdir / "model.safetensors"))

    extract = out / "extract"
    mix = torch.randn(3, generator=g).softmax(0)
    entries = []
    for i in range(SAMPLES):
        aux = torch.randn(tokens, 3, H, generator=g)
        final = (aux * mix[None, :, None]).sum(1) * 4  # learnable from the auxiliary states
        ids = torch.randint(0, V, (tokens,), generator=g)
        mask = torch.ones(tokens, dtype=torch.uint8)
        sample = shards.SampleStates(aux.to(torch.bfloat16), final.to(torch.bfloat16), ids, mask)
        path = extract / manifest.shard_name(i)
        extract.mkdir(parents=True, exist_ok=True)
        entries.append(shards.write_shard(path, [sample], i, fingerprint=f"gpu-check-{i}"))
    record = {
        "format_version": manifest.FORMAT_VERSION,
        "layer_convention": manifest.LAYER_CONVENTION,
        "aux_layer_ids": [2, s["layers"] // 2, s["layers"] - 3],
        "final_layer_id": s["layers"],
        "hidden_size": H,
        "num_hidden_layers": s["layers"],
        "vocab_size": V,
        "dtype": "bfloat16",
        "verifier": {"path": str(vdir), **verifier_files.identity(vdir)},
        "tokenized": {"path": "synthetic", "sha256": "0" * 64},
        "num_samples": SAMPLES,
        "num_tokens": SAMPLES * tokens,
        "shards": entries,
    }
    (extract / "manifest.json").write_text(json.dumps(record, indent=2))
    selected = torch.randperm(V, generator=g)[:draft_vocab].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[selected] = True
    save_file(
        {"d2t": selected - torch.arange(draft_vocab), "t2d": t2d},
        str(out / "vocab_map.safetensors"),
    )
    print(f"prepared {SAMPLES} samples of {tokens} tokens, hidden {H}, vocabulary {V} in {out}")


def train_args(out: Path, small: bool) -> list[str]:
    from workflow_scripts.lib.workflow import cli
    from workflow_scripts.lib.workflow.definitions import TrainParams

    _, _, tokens = shape(small)
    params = TrainParams(
        ttt_steps=7,
        ttt_step_loss_decay=0.8,
        epochs=2,
        micro_batch_budget_tokens=tokens,
        learning_rate=5e-4,
        warmup_steps=2,
        validation_fraction=0.0,
        validate_every_steps=1000,
        checkpoint_every_steps=1000,
        log_every_steps=1,
        num_gpus=0 if small else 1,
    )
    files = {
        "manifest": out / "extract" / "manifest.json",
        "engine_cmd": "",
        "vocab_map": out / "vocab_map.safetensors",
        "verifier": out / "verifier",
        "state_dir": out / "state",
        "draft": out / "draft",
        "metrics": out / "metrics.jsonl",
    }
    return shlex.split(cli.render("train", params, files))


def report(log: Path) -> None:
    text = log.read_text()
    steps = re.findall(r"step (\d+)/\d+ .*?loss ([\d.]+).*?([\d.]+) tokens/s", text)
    peaks = re.findall(r"peak GPU memory ([\d.]+) GiB", text)
    if not steps:
        raise SystemExit(f"{log}: no training step logged")
    losses = [float(loss) for _, loss, _ in steps]
    rates = [float(rate) for _, _, rate in steps[1:]] or [float(steps[0][2])]
    print(f"steps {len(steps)}: loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    print(f"tokens/s after the first step: {sum(rates) / len(rates):.0f}")
    if peaks:
        print(f"peak GPU memory: {max(map(float, peaks)):.1f} GiB")
    print("the loss fell" if losses[-1] < losses[0] else "THE LOSS DID NOT FALL")


def fp8(small: bool) -> None:
    """The float8 storage encoding where extraction runs it on a GPU (before the copy to host
    memory): the same bytes as on the CPU, and its speed."""
    import time

    import torch

    from workflow_scripts.lib.hidden_states import shards

    device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg, _, tokens = shape(small)
    g = torch.Generator().manual_seed(0)
    aux = torch.randn(tokens, 3, cfg["hidden"], generator=g).to(torch.bfloat16)
    aux[:, :, :4] *= 300  # a few large channels, as verifiers have
    final = torch.randn(tokens, cfg["hidden"], generator=g).to(torch.bfloat16)
    on_cpu = shards.encode_states(aux, final, shards.FP8)
    aux_d, final_d = aux.to(device), final.to(device)
    shards.encode_states(aux_d, final_d, shards.FP8)  # warm-up
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    on_device = shards.encode_states(aux_d, final_d, shards.FP8)
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    same = all(
        torch.equal(on_cpu[k].view(torch.uint8) if on_cpu[k].dtype == shards.FP8 else on_cpu[k],
                    (on_device[k].view(torch.uint8) if on_device[k].dtype == shards.FP8
                     else on_device[k]).cpu())
        for k in on_cpu
    )  # fmt: skip
    stored = sum(v.numel() * v.element_size() for v in on_device.values())
    print(
        f"float8 encoding on {device}: {tokens} tokens x 4 layers x {cfg['hidden']} in "
        f"{seconds * 1e3:.1f} ms ({aux.numel() * 2 * 4 / 3 / seconds / 1e9:.1f} GB/s of bfloat16 "
        f"read), {stored / tokens:.0f} bytes per token stored; same bytes as on the CPU: {same}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("what", choices=["prepare", "args", "report", "fp8"])
    ap.add_argument("path", type=Path, nargs="?")
    ap.add_argument("--small", action="store_true")
    a = ap.parse_args()
    if a.what == "prepare":
        prepare(a.path, a.small)
    elif a.what == "args":
        print(shlex.join(train_args(a.path, a.small)))
    elif a.what == "fp8":
        fp8(a.small)
    else:
        report(a.path)


if __name__ == "__main__":
    main()
