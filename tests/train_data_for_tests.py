"""A tiny Llama verifier and its hidden-state shards, made here with transformers (nothing is
downloaded): the inputs of the training stage, in the formats of ``lib/hidden_states/shards.py``
and ``lib/draft/vocab_map.py``.

Hidden states follow vLLM's convention: aux id k = HF ``hidden_states[k]`` (the input of decoder
layer k); the final state is the last decoder layer's output *before* the final norm (HF's
``hidden_states[N]`` is after it, so it is taken with a hook).
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

from tests import factories
from workflow_scripts.lib.draft.vocab_map import build_maps, select_vocab
from workflow_scripts.lib.hidden_states import manifest, shards
from workflow_scripts.lib.hidden_states.shard_writer import write_samples
from workflow_scripts.lib.workflow import cli
from workflow_scripts.lib.workflow.definitions import TrainParams
from workflow_scripts.lib.workflow.layout import MANIFEST, METRICS, Layout


def tiny_verifier(
    vocab_size=256, hidden=64, layers=4, heads=4, kv_heads=2, inter=128, seed=0
) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
    )
    model = LlamaForCausalLM(cfg).float().eval()
    # larger than the default init, so the distributions are not all near uniform
    with torch.no_grad():
        model.lm_head.weight.normal_(0, 0.5)
    return model


def save_verifier(model: LlamaForCausalLM, out_dir: Path) -> Path:
    model.config.architectures = ["LlamaForCausalLM"]
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def synthetic_sequences(n: int, vocab_size: int, length: int, seed: int, noise: float = 0.1):
    """A small 'language': x_{t+1} = f[x_t, x_{t-1} mod 2] with probability 1 - noise, else a
    random token. Predictable from two tokens of context, so a trained verifier is predictable
    and a draft has something to learn from the verifier's features."""
    rng = np.random.default_rng(seed)
    table = rng.integers(2, vocab_size, size=(vocab_size, 2))
    out = np.zeros((n, length), dtype=np.int64)
    out[:, :2] = rng.integers(2, vocab_size, size=(n, 2))
    for t in range(2, length):
        nxt = table[out[:, t - 1], out[:, t - 2] % 2]
        flip = rng.random(n) < noise
        out[:, t] = np.where(flip, rng.integers(2, vocab_size, size=n), nxt)
    return torch.from_numpy(out), table


def train_verifier(model: LlamaForCausalLM, sequences: torch.Tensor, steps: int, lr=3e-3, batch=32):
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        rows = sequences[torch.randint(0, len(sequences), (batch,), generator=g)]
        loss = model(input_ids=rows, labels=rows).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    return float(loss)


def random_samples(n: int, vocab_size: int, seed: int, min_len=12, max_len=48):
    """(input_ids, loss_mask) pairs: a 'prompt' then an 'answer' (the masked part)."""
    rng = np.random.default_rng(seed)
    samples = []
    for _ in range(n):
        length = int(rng.integers(min_len, max_len + 1))
        ids = torch.from_numpy(rng.integers(2, vocab_size, size=length)).long()
        mask = torch.zeros(length, dtype=torch.uint8)
        mask[int(rng.integers(1, length // 2)) :] = 1
        samples.append((ids, mask))
    return samples


@torch.no_grad()
def hidden_states(model: LlamaForCausalLM, ids: torch.Tensor, aux_ids: list[int]):
    captured = {}

    def hook(_module, _args, output):
        captured["final"] = output[0] if isinstance(output, tuple) else output

    handle = model.model.layers[-1].register_forward_hook(hook)
    try:
        out = model(input_ids=ids[None], output_hidden_states=True)
    finally:
        handle.remove()
    aux = torch.stack([out.hidden_states[k][0] for k in aux_ids], dim=1)  # [T, m, H]
    return aux.float(), captured["final"][0].float()


def write_extraction(
    model: LlamaForCausalLM,
    verifier_dir: Path,
    samples,
    out_dir: Path,
    aux_ids: list[int],
    shard_size: int = 16,
    storage: str = "float32",
) -> Path:
    """Shards and a manifest as the extraction stage writes them (states stored as
    ``storage``)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for s0 in range(0, len(samples), shard_size):
        states = []
        for ids, mask in samples[s0 : s0 + shard_size]:
            aux, final = hidden_states(model, ids, aux_ids)
            states.append(shards.SampleStates(aux, final, ids, mask))
        path = out_dir / manifest.shard_name(len(paths))
        meta = {"fingerprint": f"test-{s0}", "sample_start": str(s0)}
        write_samples(path, states, meta, storage=shards.TORCH_DTYPES[storage])
        paths.append(path)
    record = factories.manifest(
        paths, out_dir, verifier_dir, list(aux_ids), storage=storage, shard_size=shard_size
    )
    path = out_dir / MANIFEST
    record.write(path)
    return path


def write_vocab_map(path: Path, samples, vocab_size: int, draft_vocab_size: int) -> Path:
    counts = np.zeros(vocab_size, dtype=np.int64)
    for ids, mask in samples:
        counts += np.bincount(ids[mask.bool()].numpy(), minlength=vocab_size)
    d2t, t2d = map(torch.from_numpy, build_maps(select_vocab(counts, draft_vocab_size), vocab_size))
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({"d2t": d2t, "t2d": t2d, "token_counts": torch.from_numpy(counts)}, str(path))
    return path


@dataclass
class TrainInputs:
    verifier: Path
    manifest: Path
    vocab_map: Path

    def args(self, out: Path, **params) -> list[str]:
        """The train script's command line for outputs under ``out``."""
        files = {
            "manifest": self.manifest,
            "engine_cmd": "",
            "vocab_map": self.vocab_map,
            "verifier": self.verifier,
            "state_dir": out / "state",
            "draft": out / "draft",
            "metrics": out / METRICS,
        }
        return shlex.split(cli.render("train", TrainParams(**params), files))


def build_inputs(
    root: Path,
    model: LlamaForCausalLM | None = None,
    samples=None,
    aux_ids=(1, 2, 3),
    draft_vocab_size: int = 64,
    shard_size: int = 16,
    storage: str = "float32",
) -> TrainInputs:
    model = model if model is not None else tiny_verifier()
    samples = samples if samples is not None else random_samples(64, model.config.vocab_size, 0)
    verifier = save_verifier(model, root / "verifier")
    manifest = write_extraction(
        model, verifier, samples, root / "extract", list(aux_ids), shard_size, storage
    )
    vocab_map = write_vocab_map(
        Layout(root).vocab.vocab_map, samples, model.config.vocab_size, draft_vocab_size
    )
    return TrainInputs(verifier, manifest, vocab_map)


def read_metrics(path: Path, split: str = "train") -> list[dict]:
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return [r for r in rows if r["split"] == split]
