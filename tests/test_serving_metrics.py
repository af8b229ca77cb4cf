"""Metrics that match what serving measures: training's acceptance as vLLM's greedy chain
against the verifier's argmax over its whole vocabulary, the draft kept from the best validation
by simulated acceptance length, and evaluation's intervals over prompts."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tests import factories
from tests.test_train import FAST, small_draft
from tests.train_data_for_tests import build_inputs, read_metrics
from workflow_scripts.lib.draft.greedy_walk import walk_answers
from workflow_scripts.lib.draft.model import TeacherHead, shift_left
from workflow_scripts.lib.evaluation.acceptance import acceptance_with_ci, simulated_acceptance
from workflow_scripts.lib.training.loader import MicroBatch
from workflow_scripts.lib.training.build import only_in_draft_vocab, summarize, with_aux_noise
from workflow_scripts.stages import train
from workflow_scripts.lib.workflow.layout import METRICS


@torch.no_grad()
def test_acceptance_chain_follows_vllm_greedy():
    """Against a reference written position by position: a draft token counts as served when,
    mapped to the verifier's ids, it is the verifier's argmax over its whole vocabulary (50 ids,
    20 in the draft vocabulary: the argmax is often outside it); an anchor's token at step k is accepted when those of steps
    0..k all are."""
    model = small_draft()  # draft vocabulary 20
    torch.manual_seed(5)
    B, L, S, V, H = 3, 17, 4, 50, 32
    draft_to_verifier = torch.sort(torch.randperm(V)[:20]).values
    head = torch.randn(V, H)
    teacher = TeacherHead(
        torch.rand(H) + 0.5, head[draft_to_verifier], 1e-6, head, draft_to_verifier
    )
    aux, final = torch.randn(B, L, 3, H), torch.randn(B, L, H)
    ids = torch.randint(0, V, (B, L))
    mask = torch.rand(B, L) < 0.8
    mask[2, 11:] = False  # padding
    _, stats = model(aux, final, ids, mask, teacher, S, walk=True)

    n = L - 1
    outputs = model.unroll(aux, ids, S)
    verifier_top1 = (teacher.normed(final) @ head.T).argmax(-1)  # [B, L]
    anchors = shift_left(mask, 2, n)
    alive = anchors.clone()
    chain = torch.zeros(B, n, dtype=torch.int64)
    for k in range(S):
        counted = shift_left(mask, 2 + k, n)
        draft = draft_to_verifier[model.lm_head(model.norm(outputs[k])).argmax(-1)]  # [B, n]
        served = torch.zeros_like(counted)
        for b, t in counted.nonzero().tolist():
            served[b, t] = draft[b, t] == verifier_top1[b, t + 1 + k]
        alive &= served
        assert stats["served"][k] == served.sum()
        assert stats["accepted"][k] == alive.sum() and stats["anchors"][k] == anchors.sum()
        chain += alive.long()  # greedy decoding at k + 1 drafts a step counts these chains
        assert (stats["walk_steps"][k], stats["walk_accepted"][k]) == walk_answers(anchors, chain)
    # served implies right inside the draft vocabulary, not the reverse: that overstates
    assert (stats["served"] <= stats["correct"]).all()
    assert stats["served"].sum() < stats["correct"].sum()
    assert (stats["accepted"][1:] <= stats["accepted"][:-1]).all()

    summary = summarize(torch.stack([stats[k] for k in stats]), 1.0, num_speculative_tokens=3)
    rates = (stats["accepted"] / stats["anchors"]).tolist()
    assert summary["acceptance_per_position"] == pytest.approx(rates, abs=1e-6)
    assert summary["simulated_acceptance_length"] == pytest.approx(1 + sum(rates[:3]), abs=1e-5)
    walked = (1 + stats["walk_accepted"] / stats["walk_steps"]).tolist()
    assert summary["walked_acceptance_by_k"] == pytest.approx(walked, abs=1e-6)
    _, unwalked = model(aux, final, ids, mask, teacher, S)  # training's steps: not counted
    assert "walked_acceptance_by_k" not in summarize(torch.stack(list(unwalked.values())), 1.0, 3)


def test_the_draft_is_the_best_validation(tmp_path):
    """Validation every 4 steps: the draft written holds the weights of the validation with the
    best simulated acceptance length (not the last step's), and the metrics end with a
    ``selected`` row that names it."""
    inputs = build_inputs(tmp_path / "in")
    out = tmp_path / "out"
    # a high learning rate: the validations differ, the last is not always the best
    params = {**FAST, "validation_fraction": 0.25, "validate_every_steps": 4, "learning_rate": 3e-2}
    train.main(inputs.args(out, epochs=4, **params))
    rows = read_metrics(out / METRICS, "val")
    selected = read_metrics(out / METRICS, "selected")
    assert len(rows) >= 3 and len(selected) == 1
    scores = [r["simulated_acceptance_length"] for r in rows]
    best = max(range(len(rows)), key=lambda i: (scores[i], i))  # the latest of equal ones
    assert selected[0]["step"] == rows[best]["step"]
    assert selected[0]["simulated_acceptance_length"] == scores[best]
    for r in rows:
        assert len(r["acceptance_per_position"]) == 3
        assert r["simulated_acceptance_length"] == pytest.approx(
            1 + sum(r["acceptance_per_position"]), abs=1e-5
        )
        assert all(
            a <= b + 1e-9
            for a, b in zip(r["acceptance_per_position"][1:], r["acceptance_per_position"])
        )
    draft = load_file(str(out / "draft" / "model.safetensors"))
    kept = torch.load(out / "state" / "best.pt")
    assert torch.equal(draft["fc.weight"], kept["fc.weight"].to(draft["fc.weight"].dtype))
    assert json.loads((out / "state" / "best.json").read_text())["step"] == selected[0]["step"]
    if selected[0]["step"] != rows[-1]["step"]:  # then the last step's weights were not kept
        last = torch.load(out / "state" / "state.pt", weights_only=False)["model"]["fc.weight"]
        assert not torch.equal(kept["fc.weight"], last)


def test_bootstrap_interval_over_prompts():
    rng = np.random.default_rng(1)
    few = [list(rng.multinomial(8, [0.2, 0.3, 0.3, 0.2])) for _ in range(10)]
    many = few * 20
    a, b = acceptance_with_ci(few), acceptance_with_ci(few + [None, [0, 0, 0, 0]])
    assert a == b  # prompts without drafts are not counted
    pooled = np.array(few).sum(0)
    assert a["mean_acceptance_length"] == pytest.approx(
        1 + (pooled * np.arange(4)).sum() / pooled.sum()
    )
    assert a["acceptance_rate_per_position"][0] == pytest.approx(pooled[1:].sum() / pooled.sum())
    lo, hi = a["mean_acceptance_length_ci95"]
    assert lo < a["mean_acceptance_length"] < hi
    lo2, hi2 = acceptance_with_ci(many)["mean_acceptance_length_ci95"]
    assert hi2 - lo2 < (hi - lo) / 3  # 20 x the prompts: about sqrt(20) x narrower
    assert acceptance_with_ci(few) == a  # seeded
    assert acceptance_with_ci([None])["num_prompts"] == 0


def test_evaluation_reads_what_training_selected(tmp_path):
    rows = [
        factories.metrics_row(4, "val", [0.5, 0.25, 0.1]),
        factories.metrics_row(8, "val", [0.4, 0.2, 0.1]),
        factories.metrics_row(4, "selected", [0.5, 0.25, 0.1]),
    ]
    path = tmp_path / METRICS
    path.write_text("".join(r.line() for r in rows))
    got = simulated_acceptance(path, 2)
    assert got == {
        "step": 4,
        "acceptance_rate_per_position": [0.5, 0.25],
        "mean_acceptance_length": 1.75,
    }
    assert simulated_acceptance(path, 4)["mean_acceptance_length"] is None  # trained for 3
    path.write_text(rows[1].line())
    assert simulated_acceptance(path, 3)["step"] == 8
    # as greedy decoding counts it, where training walked its held-out split: at evaluate's k
    walked = rows[2].model_copy(update={"walked_acceptance_by_k": [1.3, 1.45, 1.5]})
    path.write_text(walked.line())
    assert simulated_acceptance(path, 2)["walked_acceptance_length"] == 1.45
    assert "walked_acceptance_length" not in simulated_acceptance(path, 4)


# --------------------------------------------------------------------------- recipe options


def test_loss_positions_in_the_draft_vocabulary():
    """train.loss_positions verifier_top1_in_draft_vocab: a token leaves the loss mask when the
    verifier's argmax at the position before it is outside the draft vocabulary."""
    torch.manual_seed(2)
    V, H, B, L = 30, 16, 2, 9
    draft_to_verifier = torch.tensor([1, 4, 7, 9, 12, 20])
    head = torch.randn(V, H)
    teacher = TeacherHead(torch.ones(H), head[draft_to_verifier], 1e-6, head, draft_to_verifier)
    final = torch.randn(B, L, H)
    mask = torch.rand(B, L) < 0.7
    mb = MicroBatch(torch.randn(B, L, 3, H), final, torch.zeros(B, L, dtype=torch.long), mask, 9)
    got = only_in_draft_vocab(mb, teacher, "cpu").loss_mask
    top1 = (teacher.normed(final) @ head.T).argmax(-1)
    for b in range(B):
        for j in range(L):
            keep = bool(mask[b, j]) and (
                j == 0 or int(top1[b, j - 1]) in draft_to_verifier.tolist()
            )
            assert bool(got[b, j]) == keep, (b, j)
    assert got.sum() < mask.sum()


def test_aux_noise_is_uniform_and_bounded():
    torch.manual_seed(0)
    mb = MicroBatch(torch.zeros(4, 50, 3, 8), torch.zeros(4, 50, 8), torch.zeros(4, 50), None, 0)
    assert with_aux_noise(mb, 0.0) is mb
    noise = with_aux_noise(mb, 0.05).aux_hidden
    assert noise.abs().max() <= 0.05 and noise.abs().max() > 0.045
    assert abs(float(noise.mean())) < 0.002


def test_recipe_options_train(tmp_path):
    """Both options train; restricted positions count fewer training positions, and validation
    counts all of them either way."""
    inputs = build_inputs(tmp_path / "in", draft_vocab_size=16)  # of the verifier's vocabulary
    runs = {}
    for name, extra in {
        "plain": {},
        "restricted": {"loss_positions": "verifier_top1_in_draft_vocab"},
        "noise": {"aux_noise": 0.05},
    }.items():
        out = tmp_path / name
        train.main(inputs.args(out, epochs=1, **{**FAST, "validation_fraction": 0.25, **extra}))
        runs[name] = (
            read_metrics(out / METRICS),
            read_metrics(out / METRICS, "val"),
        )
    (plain, plain_val), (restricted, restricted_val), (noise, _) = runs.values()
    assert restricted[0]["positions_per_step"][0] < plain[0]["positions_per_step"][0]
    assert restricted_val[-1]["positions_per_step"] == plain_val[-1]["positions_per_step"]
    assert noise[0]["loss"] != plain[0]["loss"]
    assert noise[0]["positions_per_step"] == plain[0]["positions_per_step"]
