"""train: the draft's TTT unroll against token-by-token decoding, the teacher against the full
verifier, bad inputs stopping before the first step, exact resume after a kill, and two gloo
processes training the same model as one."""

from __future__ import annotations

import io
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from tests.train_data_for_tests import (
    build_inputs,
    hidden_states,
    random_samples,
    read_metrics,
    tiny_verifier,
)
from workflow_scripts.lib.common import UserError
from workflow_scripts.lib.draft.attention import dense_ttt_attention, ttt_attention
from workflow_scripts.lib.draft.checkpoint import (
    read_draft_checkpoint,
    speculators_config,
    write_draft_checkpoint,
)
from workflow_scripts.lib.draft.layer_config import llama_layer_config
from workflow_scripts.lib.draft.model import (
    DraftConfig,
    Eagle3Draft,
    Objective,
    Rotary,
    TeacherHead,
)
from workflow_scripts.lib.training import trainer
from workflow_scripts.lib.verifier import files as verifier_files
from workflow_scripts.lib.workflow.definitions import TrainParams
from workflow_scripts.stages import train
from workflow_scripts.lib.workflow.layout import METRICS, Layout

ROOT = Path(__file__).resolve().parents[1]
FAST = dict(
    micro_batch_budget_tokens=128,
    learning_rate=3e-3,
    warmup_steps=5,
    log_every_steps=10,
    validation_fraction=0.1,
)


@pytest.fixture(autouse=True)
def one_thread(monkeypatch):
    """These tiny models train fastest on one thread per process, and then a busy machine
    cannot stall them in OpenMP barriers (the scripts follow OMP_NUM_THREADS)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """A 4-layer random verifier, 64 samples in 4 shards, a 64-token draft vocabulary."""
    return build_inputs(tmp_path_factory.mktemp("train_inputs"))


def copy_inputs(inputs, dst: Path):
    for name in ("verifier", "extract", "vocab"):
        shutil.copytree(inputs.verifier.parent / name, dst / name)
    return type(inputs)(dst / "verifier", Layout(dst).extract.manifest, Layout(dst).vocab.vocab_map)


def run_script(args, timeout=300):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "workflow_scripts.stages.train", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# --------------------------------------------------------------------------- the model


def small_draft(seed=0, vocab=50, hidden=32, heads=4, kv_heads=2, **options):
    layer = llama_layer_config(
        dict(
            hidden_size=hidden,
            intermediate_size=64,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            vocab_size=vocab,
            rms_norm_eps=1e-6,
            max_position_embeddings=256,
            rope_parameters={"rope_type": "default", "rope_theta": 500.0},
        )
    )
    torch.manual_seed(seed)
    model = Eagle3Draft(DraftConfig.from_layer_config(layer, draft_vocab_size=20, **options))
    model.reset_parameters(std=0.3)  # large weights: attention patterns matter
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "eps") and hasattr(module, "weight"):
                module.weight.uniform_(0.5, 1.5)
    return model.eval()


def rotate(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


@torch.no_grad()
def decode_like_a_server(model: Eagle3Draft, aux, ids, ttt_steps):
    """The draft run as vLLM runs it, one token at a time with a KV cache per layer: the prefix
    fed with the verifier's features at positions 0..t, then draft token k at position t+k from
    the draft's own previous output, attending to the prefix and the tokens drafted before it;
    layers after the first take the stream of the layer before (``llama_eagle3.py``).
    Returns {(k, t): r}."""
    attn = model.layers[0].self_attn
    nh, nkv, hd = attn.n_heads, attn.n_kv, attn.head_dim
    n = ids.numel() - 1
    features = aux[:n].flatten(1)
    if model.cfg.norm_before_fc:
        features = model.input_norm(features)
    if model.cfg.fc_norm:  # as vLLM's combine_hidden_states: each layer's state, its own norm
        features = torch.cat(
            [norm(aux_k) for norm, aux_k in zip(model.fc_norm, features.chunk(3, -1))], -1
        )
    features = model.fc(features)

    def fed_back(r):
        return model.norm(r) if model.cfg.norm_output else r

    def token(t):
        return ids[t] if t < ids.numel() else torch.tensor(0)

    def qkv(layer, tok, g, pos):
        if layer is model.layers[0]:
            normed = layer.hidden_norm(g)
            residual = normed if layer.norm_before_residual else g
            x = torch.cat([layer.input_layernorm(model.embed_tokens(tok)), normed])
        else:
            residual, x = g, layer.input_layernorm(g)
        cos, sin = model.rotary(torch.tensor([pos]))
        a = layer.self_attn
        q = rotate(a.q_proj(x).view(nh, hd), cos, sin)
        k = rotate(a.k_proj(x).view(nkv, hd), cos, sin)
        return q, k, a.v_proj(x).view(nkv, hd), residual

    def attend(layer, q, keys, values, residual):
        """A query over the keys and values of every position up to its own, in order; a
        sliding layer sees the ``window`` last of them (HF's and vLLM's convention)."""
        window = layer.self_attn.window
        if window is not None:
            keys, values = keys[-window:], values[-window:]
        heads = []
        for h in range(nh):
            kv = h // (nh // nkv)
            w = torch.softmax(keys[:, kv] @ q[h] / math.sqrt(hd), dim=0)
            heads.append(w @ values[:, kv])
        r = residual + layer.self_attn.o_proj(torch.cat(heads))
        return r + layer.mlp(layer.post_attention_layernorm(r))

    # the prefix, layer by layer: each layer's keys and values at every position, and its stream
    streams, prefix = [features[t] for t in range(n)], []
    for layer in model.layers:
        rows = [qkv(layer, token(t + 1), streams[t], t) for t in range(n)]
        K0, V0 = torch.stack([r[1] for r in rows]), torch.stack([r[2] for r in rows])
        streams = [
            attend(layer, rows[t][0], K0[: t + 1], V0[: t + 1], rows[t][3]) for t in range(n)
        ]
        prefix.append((K0, V0))
    out = {}
    for t in range(n):
        out[0, t] = streams[t]
        cache = [(K0[: t + 1], V0[: t + 1]) for K0, V0 in prefix]
        g = fed_back(out[0, t])
        for k in range(1, ttt_steps):
            r = g
            for i, layer in enumerate(model.layers):
                q, kk, vv, residual = qkv(layer, token(t + 1 + k), r, t + k)
                keys = torch.cat([cache[i][0], kk[None]])
                values = torch.cat([cache[i][1], vv[None]])
                cache[i] = (keys, values)
                r = attend(layer, q, keys, values, residual)
            out[k, t] = r
            g = fed_back(r)
    return out


def assert_unrolls_as_served(model, aux, ids, steps, unrolled) -> None:
    """Each row's ``unrolled`` outputs equal decode_like_a_server's, float64 to 1e-10."""
    for b in range(ids.shape[0]):
        reference = decode_like_a_server(model, aux[b], ids[b], steps)
        for (k, t), r in reference.items():
            torch.testing.assert_close(unrolled[k][b, t], r, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize(
    "norm_before_residual, norm_before_fc, norm_output, fc_norm, num_layers",
    [
        (True, False, False, False, 1),
        (False, False, False, False, 1),
        (True, True, False, False, 1),
        (True, False, True, False, 1),
        (True, False, False, True, 1),
        (True, True, True, True, 1),
        (True, False, False, False, 2),
        (False, False, True, False, 3),
    ],
)
def test_ttt_unroll_equals_token_by_token_decoding(
    norm_before_residual, norm_before_fc, norm_output, fc_norm, num_layers
):
    model = small_draft(
        norm_before_fc=norm_before_fc,
        norm_output=norm_output,
        fc_norm=fc_norm,
        num_layers=num_layers,
    )
    model.cfg.norm_before_residual = norm_before_residual
    model.layers[0].norm_before_residual = norm_before_residual
    model.double()  # float64: any difference is a logic error, not rounding
    torch.manual_seed(1)
    L, steps = 11, 4
    aux = torch.randn(2, L, 3, 32, dtype=torch.float64)
    ids = torch.randint(0, 50, (2, L))
    with torch.no_grad():
        unrolled = model.unroll(aux, ids, steps)
    assert_unrolls_as_served(model, aux, ids, steps, unrolled)


@pytest.mark.parametrize("window, num_layers", [(4, 1), (6, 2), (9, 3)])
def test_a_sliding_window_unrolls_as_a_server_decodes_it(window, num_layers):
    """A sliding window (of 4 to 9 tokens, in every layer, over rows of 23 tokens and 4 TTT
    steps): the unrolled training forward equals decoding token by token with each query
    seeing only the window's last keys, float64 to 1e-10; and it differs from full attention."""
    model = small_draft(num_layers=num_layers, sliding_window=window).double()
    assert [layer.self_attn.window for layer in model.layers] == [window] * num_layers
    torch.manual_seed(1)
    L, steps = 23, 4
    aux = torch.randn(2, L, 3, 32, dtype=torch.float64)
    ids = torch.randint(0, 50, (2, L))
    with torch.no_grad():
        unrolled = model.unroll(aux, ids, steps)
        for layer in model.layers:
            layer.self_attn.window = None
        full = model.unroll(aux, ids, steps)
    assert not torch.allclose(unrolled[steps - 1], full[steps - 1])
    for layer in model.layers:
        layer.self_attn.window = window
    assert_unrolls_as_served(model, aux, ids, steps, unrolled)


@pytest.mark.parametrize("window", [4, 7, 40])
@pytest.mark.parametrize("kv_heads", [4, 1])
def test_windowed_attention_equals_the_dense_reference(window, kv_heads):
    """With a sliding window the banded blocks plus the diagonal terms equal the dense attention
    with the windowed mask, outputs and gradients, float64 to 1e-10, over blocks smaller than
    the row (their edges) and one block."""
    from workflow_scripts.lib.draft import attention

    torch.manual_seed(window + kv_heads)
    B, H, n, d, steps = 2, 4, 29, 8, 3
    f64 = dict(dtype=torch.float64, requires_grad=True)
    qs = [torch.randn(B, H, n, d, **f64) for _ in range(steps)]
    cache = [
        (torch.randn(B, kv_heads, n, d, **f64), torch.randn(B, kv_heads, n, d, **f64))
        for _ in range(steps)
    ]
    leaves = qs + [t for kv in cache for t in kv]
    results = []
    for attend, block in ((ttt_attention, 5), (ttt_attention, 512), (dense_ttt_attention, 0)):
        banded = attention.banded_attention_with_lse
        if block:
            attention.banded_attention_with_lse = lambda *a, _b=block, _f=banded: _f(*a, block=_b)
        try:
            outs = [attend(q, cache[: i + 1], window=window) for i, q in enumerate(qs)]
        finally:
            attention.banded_attention_with_lse = banded
        weights = torch.Generator().manual_seed(0)
        loss = sum((o * torch.randn(o.shape, generator=weights, dtype=o.dtype)).sum() for o in outs)
        results.append((outs, torch.autograd.grad(loss, leaves)))
    for outs, grads in results[:2]:
        for a, b in zip(outs + list(grads), results[2][0] + list(results[2][1])):
            torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


def test_a_window_no_larger_than_the_steps_is_refused_by_the_attention():
    q = torch.randn(1, 2, 9, 4)
    cache = [(torch.randn(1, 2, 9, 4), torch.randn(1, 2, 9, 4)) for _ in range(3)]
    with pytest.raises(ValueError, match="larger than the TTT steps"):
        ttt_attention(q, cache, window=2)


def test_ttt_rows_do_not_see_each_other_or_padding():
    """A shorter row padded to a longer one computes what it computes alone."""
    model = small_draft().double()
    torch.manual_seed(2)
    f64 = dict(dtype=torch.float64)
    aux, ids = torch.randn(1, 6, 3, 32, **f64), torch.randint(0, 50, (1, 6))
    pad_aux = torch.cat([aux, torch.randn(1, 4, 3, 32, **f64)], 1)
    pad_ids = torch.cat([ids, torch.randint(0, 50, (1, 4))], 1)
    batch_aux = torch.cat([pad_aux, torch.randn(1, 10, 3, 32, **f64)])
    batch_ids = torch.cat([pad_ids, torch.randint(0, 50, (1, 10))])
    with torch.no_grad():
        alone = model.unroll(aux, ids, 3)
        together = model.unroll(batch_aux, batch_ids, 3)
    for k in range(3):
        n_valid = 5 - k  # indices whose input tokens lie inside the short row
        torch.testing.assert_close(together[k][0, :n_valid], alone[k][0, :n_valid])


@pytest.mark.parametrize("steps", [1, 2, 3, 5, 7])
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_attention_linear_in_the_steps_equals_the_dense_reference(steps, kv_heads):
    """float64: the fused causal part plus the diagonal terms, merged by log-sum-exp, equals the
    dense attention over all steps' keys with an explicit mask, outputs and gradients to 1e-10."""
    torch.manual_seed(steps * 10 + kv_heads)
    B, H, n, d = 3, 4, 29, 8
    f64 = dict(dtype=torch.float64, requires_grad=True)
    qs = [torch.randn(B, H, n, d, **f64) for _ in range(steps)]
    cache = [(torch.randn(B, kv_heads, n, d, **f64), torch.randn(B, kv_heads, n, d, **f64))]
    cache += [
        (torch.randn(B, kv_heads, n, d, **f64), torch.randn(B, kv_heads, n, d, **f64))
        for _ in range(steps - 1)
    ]
    leaves = qs + [t for kv in cache for t in kv]
    results = []
    for attention in (ttt_attention, dense_ttt_attention):
        outs = [attention(q, cache[: i + 1]) for i, q in enumerate(qs)]
        weights = torch.Generator().manual_seed(0)
        loss = sum((o * torch.randn(o.shape, generator=weights, dtype=o.dtype)).sum() for o in outs)
        results.append((outs, torch.autograd.grad(loss, leaves)))
    (new, new_grads), (dense, dense_grads) = results
    for a, b in zip(new + list(new_grads), dense + list(dense_grads)):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize(
    "num_layers, objective",
    [
        (1, Objective()),
        (2, Objective(topk_weight=0.5, topk=4, chain=True)),
    ],
)
def test_draft_loss_and_gradients_equal_with_the_dense_attention(num_layers, objective):
    """The whole training step's loss and every gradient, float64, several right-padded rows of
    different lengths in one micro-batch, 7 TTT steps: linear attention == dense reference (also
    with two layers, the top-K term and the accepted chain)."""
    model = small_draft(kv_heads=2, num_layers=num_layers).double().train()
    torch.manual_seed(3)
    B, L, steps = 3, 23, 7
    aux = torch.randn(B, L, 3, 32, dtype=torch.float64)
    final = torch.randn(B, L, 32, dtype=torch.float64)
    ids = torch.randint(0, 50, (B, L))
    mask = torch.rand(B, L) < 0.7
    for row, length in enumerate((23, 15, 9)):  # padding: masked, and its states anything
        mask[row, length:] = False
    teacher = TeacherHead(torch.rand(32) + 0.5, torch.randn(20, 32), 1e-6).double()
    results = []
    for dense in (False, True):
        for layer in model.layers:
            layer.self_attn.dense = dense
        model.zero_grad()
        loss, stats = model(aux, final, ids, mask, teacher, steps, objective=objective)
        loss.backward()
        grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.requires_grad}
        results.append((loss.detach(), stats, grads))
    (loss, stats, grads), (ref_loss, ref_stats, ref_grads) = results
    torch.testing.assert_close(loss, ref_loss, atol=1e-10, rtol=1e-10)
    assert stats["count"].tolist() == ref_stats["count"].tolist()
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default", "rope_theta": 10000.0},
        {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ],
)
def test_rope_matches_transformers(rope):
    layer = llama_layer_config(
        dict(
            hidden_size=64,
            intermediate_size=64,
            num_attention_heads=4,
            num_key_value_heads=4,
            vocab_size=10,
            rms_norm_eps=1e-5,
            max_position_embeddings=512,
            rope_parameters=rope,
        )
    )
    from transformers import LlamaConfig

    reference = LlamaRotaryEmbedding(LlamaConfig(**layer))
    positions = torch.arange(300)
    cos_ref, sin_ref = reference(torch.zeros(1, 300, 16), positions[None])
    cos, sin = Rotary(layer)(positions)
    torch.testing.assert_close(cos, cos_ref[0])
    torch.testing.assert_close(sin, sin_ref[0])


def test_teacher_is_the_verifier_restricted_to_the_draft_vocab(inputs):
    """final_norm + selected lm_head rows on the pre-norm final state = the full verifier's
    logits at those token ids, renormalised over the draft vocabulary."""
    model = tiny_verifier()
    vcfg = json.loads((inputs.verifier / "config.json").read_text())
    t2d = load_file(str(inputs.vocab_map))["t2d"]
    located = verifier_files.locate_tensors(inputs.verifier, vcfg)
    teacher = TeacherHead(
        verifier_files.read_tensor(located["norm"]),
        verifier_files.read_tensor(located["lm_head"], rows=t2d, chunk_rows=100),
        vcfg["rms_norm_eps"],
    )
    ids = random_samples(1, 256, seed=5)[0][0]
    _, final = hidden_states(model, ids, [1])
    with torch.no_grad():
        full = model(input_ids=ids[None]).logits[0]
    expected = torch.log_softmax(full[:, t2d], dim=-1)
    torch.testing.assert_close(teacher.log_probs(final), expected, atol=1e-4, rtol=1e-4)


def test_verifier_tensors_from_sharded_and_tied_checkpoints(inputs, tmp_path):
    """Only the three tensors are read, wherever an index puts them; a tied lm_head is the
    embedding."""
    vcfg = json.loads((inputs.verifier / "config.json").read_text())
    full = load_file(str(inputs.verifier / "model.safetensors"))
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    (sharded / "config.json").write_text(json.dumps(vcfg))
    names = sorted(full)
    parts = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    weight_map = {}
    for file, part in parts.items():
        save_file({n: full[n] for n in part}, str(sharded / file))
        weight_map.update({n: file for n in part})
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    rows = torch.rand(256) < 0.3
    located = verifier_files.locate_tensors(sharded, vcfg)
    assert {k: name for k, (_, name) in located.items()} == {
        "embed": "model.embed_tokens.weight",
        "norm": "model.norm.weight",
        "lm_head": "lm_head.weight",
    }
    head = verifier_files.read_tensor(located["lm_head"], rows=rows, chunk_rows=50)
    torch.testing.assert_close(head, full["lm_head.weight"][rows])

    tied = tmp_path / "tied"
    tied.mkdir()
    (tied / "config.json").write_text(json.dumps({**vcfg, "tie_word_embeddings": True}))
    save_file(
        {n: t for n, t in full.items() if n != "lm_head.weight"}, str(tied / "model.safetensors")
    )
    tied_cfg = {**vcfg, "tie_word_embeddings": True}
    assert (
        verifier_files.locate_tensors(tied, tied_cfg)["lm_head"][1] == "model.embed_tokens.weight"
    )
    with pytest.raises(UserError, match="no lm_head.weight"):
        verifier_files.locate_tensors(tied, {**vcfg, "tie_word_embeddings": False})


def test_checkpoint_format(tmp_path):
    model = small_draft()
    layer = model.cfg.layer_config
    selected = torch.randperm(50, generator=torch.Generator().manual_seed(0))[:20].sort().values
    d2t = selected - torch.arange(20)
    t2d = torch.zeros(50, dtype=torch.bool)
    t2d[selected] = True
    cfg = speculators_config(
        layer_config=layer,
        draft_vocab_size=20,
        aux_layer_ids=[2, 4, 7],
        num_speculative_tokens=3,
        verifier_name_or_path="/models/verifier",
        verifier_architectures=["LlamaForCausalLM"],
    )
    write_draft_checkpoint(tmp_path / "draft", model.checkpoint_state_dict(), cfg, d2t, t2d)
    config, tensors = read_draft_checkpoint(tmp_path / "draft")
    assert config["speculators_model_type"] == "eagle3"
    assert config["architectures"] == ["Eagle3Speculator"]
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 7]
    assert config["transformer_layer_config"]["model_type"] == "llama"
    assert config["transformer_layer_config"]["num_hidden_layers"] == 1
    assert config["speculators_config"]["verifier"]["name_or_path"] == "/models/verifier"
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    assert tensors["fc.weight"].shape == (32, 96)
    assert tensors["layers.0.self_attn.q_proj.weight"].shape == (32, 64)
    assert tensors["lm_head.weight"].shape == (20, 32)
    assert torch.equal(tensors["d2t"], d2t) and torch.equal(tensors["t2d"], t2d)
    # the verifier's embedding, as trained with: vLLM needs it under pipeline parallelism
    assert torch.equal(tensors["embed_tokens.weight"], model.embed_tokens.weight)
    # a second layer: on the stream (q/k/v take H), its unused hidden_norm at ones as vLLM builds it
    two = Eagle3Draft(DraftConfig.from_layer_config(layer, draft_vocab_size=20, num_layers=2))
    cfg2 = {**cfg, "transformer_layer_config": two.cfg.layer_config}
    write_draft_checkpoint(tmp_path / "draft2", two.checkpoint_state_dict(), cfg2, d2t, t2d)
    config, tensors = read_draft_checkpoint(tmp_path / "draft2")
    assert config["transformer_layer_config"]["num_hidden_layers"] == 2
    assert tensors["layers.0.self_attn.q_proj.weight"].shape == (32, 64)
    assert tensors["layers.1.self_attn.q_proj.weight"].shape == (32, 32)
    assert torch.equal(tensors["layers.1.hidden_norm.weight"], torch.ones(32))
    assert not two.layers[1].hidden_norm.weight.requires_grad
    with pytest.raises(ValueError, match="lack embed_tokens.weight"):
        write_draft_checkpoint(tmp_path / "bad", model.trainable_state_dict(), cfg, d2t, t2d)
    with pytest.raises(ValueError, match="ascending"):
        speculators_config(**{**dict(
            layer_config=layer, draft_vocab_size=20, num_speculative_tokens=3,
            verifier_name_or_path="v", verifier_architectures=None), "aux_layer_ids": [4, 2, 7]})  # fmt: skip


# --------------------------------------------------------------------------- bad input


def _set_manifest(inputs, **changes):
    manifest = json.loads(inputs.manifest.read_text())
    manifest.update(changes)
    inputs.manifest.write_text(json.dumps(manifest))


def _set_verifier(inputs, **changes):
    manifest = json.loads(inputs.manifest.read_text())
    manifest["verifier"].update(changes)
    inputs.manifest.write_text(json.dumps(manifest))


def _write_map(inputs, d2t, t2d):
    save_file({"d2t": d2t, "t2d": t2d}, str(inputs.vocab_map))


def _corrupt_shard(inputs):
    shard = inputs.manifest.parent / "shard_000002.safetensors"
    data = bytearray(shard.read_bytes())
    data[-100] ^= 0xFF  # same size, one byte different
    shard.write_bytes(bytes(data))


BAD_INPUTS = {
    "aux layer id past the last layer": (
        lambda i: _set_manifest(i, aux_layer_ids=[2, 3, 4]),
        r"aux_layer_ids \[2, 3, 4\] do not fit the verifier .* 4 layers",
    ),
    "hidden size": (
        lambda i: _set_manifest(i, hidden_size=128),
        r"hidden_size 128 does not match the verifier .*hidden_size 64",
    ),
    "layer count": (
        lambda i: _set_manifest(i, num_hidden_layers=6),
        r"num_hidden_layers 6 does not match the verifier .*4 layers",
    ),
    "another verifier": (
        lambda i: _set_verifier(i, fingerprint="0" * 64),
        r"extracted from another verifier",
    ),
    "vocab map for another vocabulary": (
        lambda i: _write_map(i, torch.arange(64), torch.arange(300) < 64),
        r"built for a vocabulary of 300 tokens, but the verifier has 256",
    ),
    "draft vocab larger than the verifier's": (
        lambda i: _write_map(
            i, torch.zeros(300, dtype=torch.int64), torch.ones(300, dtype=torch.bool)
        ),
        r"draft vocabulary \(300 tokens\) is larger than the verifier's vocabulary \(256",
    ),
    "missing shard": (
        lambda i: (i.manifest.parent / "shard_000001.safetensors").unlink(),
        r"shard .*shard_000001.safetensors is missing",
    ),
    "bad checksum": (_corrupt_shard, r"shard_000002.safetensors does not match its checksum"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_stops_before_the_first_step(inputs, tmp_path, case):
    spoil, message = BAD_INPUTS[case]
    bad = copy_inputs(inputs, tmp_path)
    spoil(bad)
    with pytest.raises(UserError, match=message):
        train.main(bad.args(tmp_path / "out", epochs=1, **FAST))
    assert not (tmp_path / "out" / "state" / METRICS).exists()
    assert not (tmp_path / "out" / "draft").exists()


def test_bad_input_exits_with_the_message_before_starting_processes(inputs, tmp_path):
    bad = copy_inputs(inputs, tmp_path)
    _corrupt_shard(bad)
    proc = run_script(bad.args(tmp_path / "out", epochs=1, num_cpu_processes=2, **FAST))
    assert proc.returncode == 2, proc.stderr
    assert "does not match its checksum" in proc.stderr
    assert "starting 2 training processes" not in proc.stderr


# --------------------------------------------------------------------------- runs


def test_training_learns_and_writes_checkpoint_and_metrics(inputs, tmp_path):
    out = tmp_path / "out"
    train.main(inputs.args(out, epochs=6, checkpoint_every_steps=20, **FAST))
    rows = read_metrics(out / METRICS)
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))
    first, last = rows[0], rows[-1]
    assert last["loss"] < 0.6 * first["loss"]
    assert len(last["top1_agreement"]) == 3 and all(0 <= a <= 1 for a in last["top1_agreement"])
    assert sum(last["top1_agreement"]) > sum(first["top1_agreement"])
    validation = read_metrics(out / METRICS, "val")
    assert validation and validation[-1]["step"] == last["step"]
    config, tensors = read_draft_checkpoint(out / "draft")
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert config["draft_vocab_size"] == 64 and tensors["lm_head.weight"].shape == (64, 64)
    assert config["speculators_config"]["verifier"]["name_or_path"] == str(inputs.verifier)


def test_resume_after_kill_repeats_the_uninterrupted_run(inputs, tmp_path):
    params = dict(epochs=10, checkpoint_every_steps=10, **FAST)
    whole = run_script(inputs.args(tmp_path / "whole", **params))
    assert whole.returncode == 0, whole.stderr
    expected = read_metrics(tmp_path / "whole" / METRICS)
    total = len(expected)
    # the log: loss, per-step agreement, throughput and ETA from the first step on
    first_line = next(line for line in whole.stderr.splitlines() if f"step 1/{total} " in line)
    for part in ("loss", "top-1 agreement per TTT step [", "tokens/s", "ETA"):
        assert part in first_line, first_line
    assert {"loss", "top1_agreement", "tokens_per_s", "eta_s", "lr"} <= set(expected[0])

    args = inputs.args(tmp_path / "killed", **params)
    state = tmp_path / "killed" / "state" / trainer.STATE_FILE
    proc = subprocess.Popen(
        [sys.executable, "-m", "workflow_scripts.stages.train", *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 120
    while not state.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = torch.load(state, weights_only=False)["step"]
    assert 0 < killed_at < total, "the run ended before it could be killed"
    assert not (tmp_path / "killed" / "draft").exists()

    resumed = run_script(args)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from {state} at step {killed_at}" in resumed.stderr
    got = read_metrics(tmp_path / "killed" / METRICS)
    assert [r["step"] for r in got] == list(range(1, total + 1))
    for a, b in zip(got, expected):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6, abs=1e-7), a["step"]
        assert a["top1_agreement"] == pytest.approx(b["top1_agreement"], abs=1e-6)
    _, w_whole = read_draft_checkpoint(tmp_path / "whole" / "draft")
    _, w_resumed = read_draft_checkpoint(tmp_path / "killed" / "draft")
    for name in w_whole:
        torch.testing.assert_close(w_resumed[name], w_whole[name], atol=1e-6, rtol=1e-5)


def test_changed_settings_do_not_resume_an_old_state(inputs, tmp_path):
    out = tmp_path / "out"
    train.main(inputs.args(out, epochs=1, checkpoint_every_steps=5, **FAST))
    rows = read_metrics(out / METRICS)
    train.main(
        inputs.args(out, epochs=1, checkpoint_every_steps=5, **{**FAST, "learning_rate": 1e-3})
    )
    again = read_metrics(out / METRICS)
    assert len(again) == len(rows) and again[0]["lr"] != rows[0]["lr"]


def test_the_losses_are_what_they_say():
    """tv is 1 - alpha (alpha = sum min(p, q): speculative sampling's acceptance rate); lk_alpha
    -log alpha; lk_hybrid KL where the draft is far off and tv where it is close; each zero
    where q = p and with a gradient that moves q towards p."""
    from workflow_scripts.lib.draft.objectives import OBJECTIVES, objective_value

    g = torch.Generator().manual_seed(0)
    target = torch.log_softmax(torch.randn(5, 7, generator=g, dtype=torch.float64), -1)
    p = target.exp()
    for objective in OBJECTIVES:
        logits = torch.randn(5, 7, generator=g, dtype=torch.float64, requires_grad=True)
        lq = torch.log_softmax(logits, -1)
        kl = (p * (target - lq)).sum(-1)
        value = objective_value(objective, kl, p, lq.exp())
        alpha = torch.minimum(p, lq.exp()).sum(-1)
        expected = {
            "kl": kl,
            "tv": 1 - alpha,
            "lk_alpha": -alpha.log(),
            "lk_hybrid": torch.exp(-3 * alpha) * kl + (1 - torch.exp(-3 * alpha)) * (1 - alpha),
        }[objective]
        torch.testing.assert_close(value, expected)
        value.sum().backward()
        moved = torch.log_softmax(logits.detach() - 0.05 * logits.grad, -1)
        kl_after = (p * (target - moved)).sum(-1)
        assert objective_value(objective, kl_after, p, moved.exp()).sum() < value.sum(), objective
        same = objective_value(objective, torch.zeros(5, dtype=torch.float64), p, p)
        torch.testing.assert_close(same, torch.zeros_like(same), atol=1e-12, rtol=0)
    # the hybrid's blend is KL's at no overlap and moves to tv as alpha grows
    far = objective_value(
        "lk_hybrid", torch.tensor([2.0]), torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 1.0]])
    )
    assert far.item() == pytest.approx(2.0)


def test_the_top_k_term_is_the_cross_entropy_over_the_teachers_head():
    """topk_weight w, K: each position adds w x -sum over the teacher's K most likely tokens of
    p log q; with K the whole draft vocabulary that is the cross-entropy H(p) + KL."""
    model = small_draft().double()
    torch.manual_seed(4)
    teacher = TeacherHead(torch.rand(32) + 0.5, torch.randn(20, 32), 1e-6).double()
    draft, final = torch.randn(6, 32, dtype=torch.float64), torch.randn(6, 32, dtype=torch.float64)
    kl, plain, _, _ = model.chunk_loss(draft, final, teacher)
    p = teacher.log_probs(final).exp()
    q = torch.log_softmax(model.lm_head(model.norm(draft)).float(), -1)
    _, whole, _, _ = model.chunk_loss(draft, final, teacher, Objective(topk_weight=0.5, topk=20))
    entropy = -(p * p.log()).sum()
    torch.testing.assert_close(whole, plain + 0.5 * (entropy + kl))
    _, top1, _, _ = model.chunk_loss(draft, final, teacher, Objective(topk_weight=2.0, topk=1))
    best = p.argmax(-1, keepdim=True)
    expected = plain - 2.0 * (p.gather(-1, best) * q.gather(-1, best)).sum()
    torch.testing.assert_close(top1, expected)


def test_the_accepted_chain_trains_no_step_past_a_rejected_token():
    """ttt_positions accepted_chain: a draft whose every first token is rejected (its lm_head all
    zeros proposes draft token 0, whose verifier row is zeros: below the 49 random others) trains
    step 0 only, with the same loss as a one-step unroll; every step's denominator stays, and the
    statistics count every position as before."""
    model = small_draft().double()
    with torch.no_grad():
        model.lm_head.weight.zero_()  # uniform: the argmax is draft token 0
    torch.manual_seed(5)
    B, L = 2, 17
    aux = torch.randn(B, L, 3, 32, dtype=torch.float64)
    final = torch.randn(B, L, 32, dtype=torch.float64)
    ids = torch.randint(0, 50, (B, L))
    mask = torch.ones(B, L, dtype=torch.bool)
    head = torch.randn(50, 32, dtype=torch.float64)
    d2t = torch.arange(20) * 2  # draft token i is verifier token 2i
    head[0] = 0  # logit 0: never the verifier's argmax
    teacher = TeacherHead(torch.ones(32, dtype=torch.float64), head[d2t], 1e-6, head, d2t).double()
    denominators = [float(B * (L - 2 - k)) for k in range(3)]
    chain = Objective(chain=True)
    loss, stats = model(aux, final, ids, mask, teacher, 3, 1.0, denominators, chain)
    first, _ = model(aux, final, ids, mask, teacher, 1, 1.0, denominators[:1])
    every, every_stats = model(aux, final, ids, mask, teacher, 3, 1.0, denominators)
    assert stats["served"][0] == 0 and stats["accepted"].sum() == 0
    torch.testing.assert_close(loss, first)
    assert every > loss
    for key in ("kl", "count", "correct", "served"):
        torch.testing.assert_close(stats[key], every_stats[key])


def test_the_learning_rate_schedules():
    from workflow_scripts.lib.training.build import lr_factor

    assert [lr_factor(s, 2, 10, 0.0, "linear") for s in (0, 1, 2, 6, 10)] == pytest.approx(
        [0.5, 1.0, 1.0, 0.5, 0.0]
    )
    assert lr_factor(2, 2, 10, 0.1, "cosine") == pytest.approx(1.0)
    assert lr_factor(6, 2, 10, 0.1, "cosine") == pytest.approx(0.55)
    assert lr_factor(10, 2, 10, 0.1, "cosine") == pytest.approx(0.1)


def test_muon_with_adamw_resumes_from_its_state_dict():
    """The Muon + AdamW pair is one optimizer to the scheduler and the resume state: Muon holds
    exactly the hidden weight matrices, and a copy restored from the saved state dict takes the same
    next step as the original."""
    from workflow_scripts.lib.training.build import make_optimizer
    from workflow_scripts.lib.workflow.definitions import TrainParams

    p = TrainParams(optimizer="muon")

    def step(model, opt, seed):
        g = torch.Generator().manual_seed(seed)
        for q in model.parameters():
            if q.requires_grad:
                q.grad = torch.randn(q.shape, generator=g)
        opt.step()

    a = small_draft(fc_norm=True)
    opt_a = make_optimizer(a, p)
    muon, adamw = opt_a.optimizers
    by_id = {id(q): n for n, q in a.named_parameters()}
    in_muon = {by_id[id(q)] for g in muon.param_groups for q in g["params"]}
    assert in_muon == {n for n, q in a.named_parameters() if q.requires_grad and q.ndim == 2
                       and not n.startswith("lm_head.")}  # fmt: skip
    assert "fc.weight" in in_muon and len(opt_a.param_groups) == 2
    step(a, opt_a, 0)
    b = small_draft(fc_norm=True)
    b.load_state_dict(a.state_dict())
    opt_b = make_optimizer(b, p)
    saved = io.BytesIO()  # as the resume state goes: through torch.save
    torch.save(opt_a.state_dict(), saved)
    saved.seek(0)
    opt_b.load_state_dict(torch.load(saved))
    step(a, opt_a, 1)
    step(b, opt_b, 1)
    for (name, qa), qb in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(qa, qb, rtol=0, atol=0, msg=name)


def test_the_reference_recipe_trains_as_set(inputs, tmp_path):
    """speculators' settings in one run: Muon on the weight matrices and AdamW on the rest, a
    linear schedule to 0, the lm_head frozen at the verifier's rows, the final norm from ones,
    the checkpoint of the lowest validation loss; per-layer fc norms and the LK loss; it learns,
    and the checkpoint says what vLLM needs to serve it."""
    out = tmp_path / "out"
    recipe = dict(optimizer="muon", lr_schedule="linear", min_lr_ratio=0.0, freeze_lm_head=True,
                  final_norm_init="ones", select_by="validation_loss", fc_norm=True,
                  loss="lk_hybrid", validate_every_steps=5)  # fmt: skip
    train.main(inputs.args(out, epochs=4, checkpoint_every_steps=1000, **{**FAST, **recipe}))
    rows = read_metrics(out / METRICS)
    assert rows[-1]["loss"] < 0.8 * rows[0]["loss"]
    assert rows[-1]["lr"] < 0.1 * max(r["lr"] for r in rows)  # linear, towards 0
    config, tensors = read_draft_checkpoint(out / "draft")
    assert config["fc_norm"] is True
    assert {f"fc_norm.{i}.weight" for i in range(3)} <= set(tensors)
    vcfg = verifier_files.verifier_config(inputs.verifier)
    where = verifier_files.locate_tensors(inputs.verifier, vcfg)
    import safetensors.torch as st

    t2d = st.load_file(str(inputs.vocab_map))["t2d"].bool()
    head = verifier_files.read_tensor(where["lm_head"], rows=t2d).float()
    torch.testing.assert_close(tensors["lm_head.weight"].float(), head)  # frozen
    assert not torch.allclose(tensors["norm.weight"], torch.ones_like(tensors["norm.weight"]))
    validation = read_metrics(out / METRICS, "val")
    selected = read_metrics(out / METRICS, "selected")[-1]
    assert selected["loss"] == min(v["loss"] for v in validation)


def test_two_gloo_processes_train_the_same_model_as_one(inputs, tmp_path):
    common = dict(epochs=2, checkpoint_every_steps=1000, **FAST)
    one = run_script(inputs.args(tmp_path / "one", grad_accum_steps=2, **common))
    assert one.returncode == 0, one.stderr
    two = run_script(inputs.args(tmp_path / "two", num_cpu_processes=2, **common))
    assert two.returncode == 0, two.stderr
    assert "starting 2 training processes" in two.stderr
    rows_one = read_metrics(tmp_path / "one" / METRICS)
    rows_two = read_metrics(tmp_path / "two" / METRICS)
    assert len(rows_one) == len(rows_two) > 10
    for a, b in zip(rows_one, rows_two):
        assert a["tokens"] == b["tokens"] and a["positions_per_step"] == b["positions_per_step"]
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4), a["step"]
    _, w_one = read_draft_checkpoint(tmp_path / "one" / "draft")
    _, w_two = read_draft_checkpoint(tmp_path / "two" / "draft")
    for name in w_one:
        torch.testing.assert_close(w_two[name], w_one[name], atol=1e-4, rtol=1e-3)


# --------------------------------------------------------------------------- train.init_from


def published_copy(draft: Path, dst: Path, keep_tokens: int) -> Path:
    """The draft as a published one may ship: EAGLE-3's first tensor names (midlayer.), no
    embedding, and a draft vocabulary of its own (the first ``keep_tokens`` of this one's, in
    reverse order, and as many tokens this one lacks)."""
    config, tensors = read_draft_checkpoint(draft)
    tokens = torch.arange(len(tensors["d2t"])) + tensors["d2t"]
    kept = tokens[:keep_tokens].flip(0)
    others = torch.tensor([t for t in range(len(tensors["t2d"])) if t not in set(tokens.tolist())])
    theirs = torch.cat([kept, others[:keep_tokens]]).sort().values
    row = {int(t): i for i, t in enumerate(tokens.tolist())}
    head = torch.stack(
        [
            tensors["lm_head.weight"][row[int(t)]] if int(t) in row else torch.zeros(64)
            for t in theirs
        ]
    )
    out = {
        ("midlayer." + k[len("layers.0.") :] if k.startswith("layers.0.") else k): v
        for k, v in tensors.items()
        if k not in ("embed_tokens.weight", "d2t", "t2d", "lm_head.weight")
    }
    out["lm_head.weight"] = head
    out["d2t"] = theirs - torch.arange(len(theirs))
    dst.mkdir(parents=True)
    save_file(out, str(dst / "model.safetensors"))
    (dst / "config.json").write_text(json.dumps({**config, "draft_vocab_size": len(theirs)}))
    return dst


def test_training_starts_from_an_existing_draft(inputs, tmp_path):
    """train.init_from: the draft as training builds it takes the old draft's weights (EAGLE-3's
    first tensor names read as layers.0), its lm_head rows by token for the tokens both draft
    vocabularies hold (the verifier's rows for the rest), and training from it starts where the
    old draft ended, far below the loss of a start from nothing."""
    from workflow_scripts.lib.training import inputs as training_inputs
    from workflow_scripts.lib.training import build as training_setup
    from workflow_scripts.lib.workflow import cli

    cold = tmp_path / "cold"
    train.main(inputs.args(cold, epochs=6, **FAST))
    published = published_copy(cold / "draft", tmp_path / "published", keep_tokens=40)

    io, p = cli.parse("train", inputs.args(tmp_path / "warm", init_from=str(published), **FAST))
    checked = training_inputs.check_inputs(io, p, verify_checksums=False)
    model, _ = training_setup.build_draft(checked, p)
    _, old = read_draft_checkpoint(cold / "draft")
    start = model.checkpoint_state_dict()
    for name, tensor in old.items():
        if name not in ("lm_head.weight", "d2t", "t2d"):
            torch.testing.assert_close(start[name], tensor, msg=name)
    start_cold, _ = training_setup.build_draft(
        checked, cli.parse("train", inputs.args(tmp_path))[1]
    )
    head, head_cold = start["lm_head.weight"], start_cold.lm_head.weight
    for i in range(len(checked.d2t)):  # this draft's vocabulary is the old one's
        expected = old["lm_head.weight"][i] if i < 40 else head_cold[i]
        torch.testing.assert_close(head[i], expected, msg=f"row {i}")

    train.main(inputs.args(tmp_path / "warm", init_from=str(published), epochs=1, **FAST))
    first_cold = read_metrics(cold / METRICS)[0]["loss"]
    last_cold = read_metrics(cold / METRICS)[-1]["loss"]
    first_warm = read_metrics(tmp_path / "warm" / METRICS)[0]["loss"]
    assert first_warm < 0.5 * (first_cold + last_cold), (first_cold, first_warm, last_cold)


@pytest.mark.parametrize(
    "change, message",
    [
        (
            {"num_draft_layers": 2},
            r"its number of layers: 1 where training's is 2; set train\.num_draft_layers",
        ),
        (
            {"draft_layer": "qwen3"},
            r"its layer: 'llama' where training's is 'qwen3'; set train\.draft_layer",
        ),
        (
            {"norm_output": True},
            r"norm_output: False where training's is True; set train\.norm_output",
        ),
        (
            {"norm_before_residual": False},
            r"norm_before_residual: True where training's is False; set train\.norm_before_residual",
        ),
        (
            {"aux": [0, 1, 3]},
            r"auxiliary layers: \[1, 2, 3\] where extraction's is \[0, 1, 3\]; set extract\.aux_layer_ids: \[1, 2, 3\]",
        ),
        (
            {"hidden_size": 32},
            r"its hidden_size: 64 where the verifier's is 32; it is a draft of another verifier",
        ),
    ],
)
def test_a_draft_training_cannot_start_from_is_refused(inputs, tmp_path, change, message):
    """train.init_from's check (the dry-run's and the job's) names each mismatch and its fix."""
    from workflow_scripts.lib.training.init_from import check_init_draft

    cold = tmp_path / "cold"
    train.main(inputs.args(cold, epochs=1, **FAST))
    vcfg = verifier_files.verifier_config(inputs.verifier)
    check_init_draft(cold / "draft", TrainParams(), vcfg, [1, 2, 3])  # the same shape: taken
    aux = change.pop("aux", [1, 2, 3])
    if "hidden_size" in change:
        vcfg = {**vcfg, "hidden_size": change.pop("hidden_size")}
    with pytest.raises(UserError, match=message):
        check_init_draft(cold / "draft", TrainParams(**change), vcfg, aux)
