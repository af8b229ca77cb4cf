"""evaluate's prompts: the rows it takes, and every bad row named with file and line (the
engines themselves run in tests/test_pipeline.py; sets in other layouts in tests/test_data.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from tests.bad_rows import EVERY_BAD_ROW, refusing_tokenizer
from tests.tokenizers_for_tests import build_chatml_tokenizer
from workflow_scripts.lib.chat.template import ChatTemplate
from workflow_scripts.lib.common import UserError
from workflow_scripts.lib.evaluation.acceptance import load_prompt_sets
from workflow_scripts.lib.workflow.sources import PromptSource

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """The chat template (ChatML, refusing one message) as evaluate serves it."""
    chatml = build_chatml_tokenizer(tmp_path_factory.mktemp("chatml"))
    path = refusing_tokenizer(tmp_path_factory.mktemp("refusing"), chatml)
    return ChatTemplate(AutoTokenizer.from_pretrained(path), verifier_dir=path)


def load_prompts(path: Path, template, limit: int | None) -> list[dict]:
    """The prompts of one file, as evaluate reads a set."""
    return load_prompt_sets([PromptSource(path=str(path))], template, limit)


def write(path: Path, lines: list[bytes]) -> Path:
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def test_prompts_from_both_row_kinds(tokenizer, tmp_path):
    rows = [
        json.dumps({"id": "a", "prompt": QUESTION[0]["content"]}).encode(),
        b"",
        json.dumps({"messages": QUESTION}).encode(),
        json.dumps({"conversations": [{"from": "human", "value": "hi"}]}).encode(),
    ]
    path = write(tmp_path / "p.jsonl", rows)
    prompts = load_prompts(path, tokenizer, None)
    assert [p["id"] for p in prompts] == ["a", f"{path}:3", f"{path}:4"]
    assert {p["set"] for p in prompts} == {"p"}
    assert prompts[0]["prompt_token_ids"] == tokenizer.prompt_ids(QUESTION)
    assert prompts[0]["prompt_token_ids"] == prompts[1]["prompt_token_ids"]
    assert len(load_prompts(tmp_path / "p.jsonl", tokenizer, 2)) == 2
    one = PromptSource(path=str(path), rows=1)
    assert len(load_prompt_sets([one], tokenizer, 2)) == 1  # the set's own rows
    with pytest.raises(UserError, match=r"p.jsonl:1: the prompt has \d+ tokens.*max_model_len"):
        load_prompt_sets([one], tokenizer, None, max_len=3)


BAD_PROMPTS = [raw for raw, reason in EVERY_BAD_ROW if reason != "no_assistant_tokens"] + [
    json.dumps({"prompt": 5}).encode(),
    json.dumps({"messages": QUESTION + [{"role": "assistant", "content": "Paris."}]}).encode(),
]


@pytest.mark.parametrize("raw", BAD_PROMPTS, ids=range(len(BAD_PROMPTS)))
def test_every_bad_prompt_is_named_with_file_and_line(tokenizer, tmp_path, raw):
    path = write(tmp_path / "p.jsonl", [json.dumps({"messages": QUESTION}).encode(), raw])
    with pytest.raises(UserError, match=rf"{re.escape(str(path))}:2: not a usable prompt: "):
        load_prompts(path, tokenizer, None)


def test_prompts_carry_tools_earlier_turns_and_tool_results(tmp_path):
    """A prompt row may hold earlier turns, tool calls, a tool result last, and a tools list: the
    prompt is the template's render of all of it with the generation prompt, with the
    serving-time arguments (here a date the template prints)."""
    from tests.chat_families import FAMILIES, build_tokenizer

    path = build_tokenizer(FAMILIES["gpt_oss"], tmp_path / "gpt_oss")
    template = ChatTemplate(AutoTokenizer.from_pretrained(path), {}, "2025-03-04", path)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
    row = {
        "tools": tools,
        "messages": [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "name": "get_weather", "content": "sunny"},
        ],
    }
    prompts = load_prompts(write(tmp_path / "p.jsonl", [json.dumps(row).encode()]), template, None)
    text = template.decode(prompts[0]["prompt_token_ids"])
    assert "get_weather" in text and '"sunny"' in text and "2025-03-04" in text
    assert text.endswith("<|start|>assistant")


def request_output(prompt_len: int, per_step: list[int], k: int = 3):
    """A finished request as vLLM returns it, with its per-step speculative-decoding record
    (vLLM's own metrics class, filled as its scheduler fills it at the detailed level)."""
    from types import SimpleNamespace

    from vllm.v1.metrics.stats import RequestSpecDecodeMetrics

    metrics = RequestSpecDecodeMetrics.new(k)
    for accepted in per_step:
        metrics.observe(num_draft_tokens=k, num_accepted=accepted, detailed=True)
    return SimpleNamespace(outputs=[SimpleNamespace(spec_decode_metrics=metrics)]), [0] * prompt_len


def test_verify_steps_fall_in_the_bucket_of_their_context():
    from workflow_scripts.lib.evaluation.acceptance import by_context

    # contexts at the steps: 10 + 1 (the prefill's token) = 11, then + 4, + 1, + 4: 11, 15, 16, 20
    out, prompt = request_output(10, [3, 0, 3, 1])
    assert by_context(out, prompt, [12, 20, 2048]) == [
        [0, 0, 0, 1],  # 11
        [1, 0, 0, 1],  # 15 and 16
        [0, 1, 0, 0],  # 20: at an edge, the next bucket
    ]
    # the buckets together are the request's histogram
    assert [sum(h) for h in zip(*by_context(out, prompt, [12, 20, 2048]))] == list(
        out.outputs[0].spec_decode_metrics.histogram
    )


def test_a_summary_record_is_refused_for_buckets():
    from vllm.v1.metrics.stats import RequestSpecDecodeMetrics

    from workflow_scripts.lib.evaluation.acceptance import by_context

    out, prompt = request_output(10, [])
    out.outputs[0].spec_decode_metrics = RequestSpecDecodeMetrics.new(3)
    out.outputs[0].spec_decode_metrics.observe(num_draft_tokens=3, num_accepted=2)  # summary
    with pytest.raises(RuntimeError, match="detailed"):
        by_context(out, prompt, [2048])


def test_acceptance_by_context_per_set_and_bucket():
    from workflow_scripts.lib.evaluation.acceptance import by_context, per_set

    edges = [16, 64, 2048]
    short = [by_context(*request_output(5, [3, 3, 3]), edges)]  # 6, 10, 14: all accepted
    long = [by_context(*request_output(60, [0, 0, 1]), edges)]  # 61, 62, 63
    prompts = [{"set": "a", "later_turns": []}, {"set": "b", "later_turns": []}]
    hists = [[sum(c) for c in zip(*h)] for h in (short[0], long[0])]
    runs = {
        "eagle3": {
            "num_drafts": 6,
            "acceptance_histograms": hists,
            "acceptance_histograms_by_context": short + long,
        }
    }
    sets = per_set(prompts, runs, edges, {"eagle3": [12, 4]})
    a, b = (sets[s]["eagle3"]["by_context"] for s in "ab")
    # output tokens a verifier pass: 12 tokens, 9 of them accepted drafts; 4 tokens, 1 accepted
    assert sets["a"]["eagle3"]["tokens_per_verifier_pass"] == pytest.approx(12 / 3)
    assert sets["b"]["eagle3"]["tokens_per_verifier_pass"] == pytest.approx(4 / 3)
    assert [x["context_tokens"] for x in a] == [[0, 16], [16, 64], [64, 2048]]
    assert [x["num_steps"] for x in a] == [3, 0, 0] and a[0]["mean_acceptance_length"] == 4
    assert [x["num_steps"] for x in b] == [0, 3, 0]
    assert b[1]["mean_acceptance_length"] == pytest.approx(1 + 1 / 3)
    assert b[0]["num_prompts"] == 0 and "mean_acceptance_length" not in b[0]


def test_tokens_a_verifier_pass_count_the_steps_that_did_not_draft():
    """vLLM's acceptance length counts the steps that drafted (1 + accepted / drafts); n-gram
    drafts only where the text so far holds a match. Output tokens a verifier pass count every
    pass that emits tokens: each emits the verifier's own token and the drafts it accepted. On
    the same output of 20 tokens: a draft drafting at each of its 7 steps after the prefill and
    accepting 12 (8 passes), against n-gram drafting at 4 of its 11 and accepting 8 (12)."""
    from workflow_scripts.lib.evaluation.acceptance import per_set, tokens_per_pass

    assert tokens_per_pass(20, 12) == pytest.approx(20 / 8)  # 1 + 12 / 8 = 2.5 in vLLM's terms
    assert tokens_per_pass(20, 8) == pytest.approx(20 / 12)  # 1 + 8 / 4 = 3.0 in vLLM's terms
    assert tokens_per_pass(0, 0) is None
    prompts = [{"set": "a", "later_turns": []}]
    runs = {
        "eagle3": {"num_drafts": 7, "acceptance_histograms": [[1, 2, 2, 2]],
                   "acceptance_histograms_by_context": [[[1, 2, 2, 2]]]},
        "ngram": {"num_drafts": 4, "acceptance_histograms": [[0, 1, 2, 1]],
                  "acceptance_histograms_by_context": [[[0, 1, 2, 1]]]},
    }  # fmt: skip
    entry = per_set(prompts, runs, [2048], {"eagle3": [20], "ngram": [20]})["a"]
    assert entry["eagle3"]["mean_acceptance_length"] == pytest.approx(1 + 12 / 7)
    assert entry["ngram"]["mean_acceptance_length"] == pytest.approx(1 + 8 / 4)
    assert entry["eagle3_over_ngram"] == pytest.approx((19 / 7) / 3)  # n-gram ahead by it
    assert entry["eagle3_over_ngram_per_pass"] == pytest.approx((20 / 8) / (20 / 12))  # EAGLE-3


def test_speedups_per_set_and_concurrency_and_over_all_sets():
    """Each speculator's tokens/s over the verifier alone's, per set and concurrency; over all
    sets, their tokens over their time (not the mean of the sets' ratios)."""
    from workflow_scripts.lib.evaluation.speed import speedups

    def run(*passes):  # (set, concurrency, tokens, seconds)
        return {
            "speed": [
                {"set": s, "concurrency": c, "output_tokens": n, "wall_s": t,
                 "output_tokens_per_s": n / t}
                for s, c, n, t in passes
            ]
        }  # fmt: skip

    runs = {
        "baseline": run(("a", 1, 100, 10.0), ("b", 1, 300, 10.0), ("a", 8, 100, 2.0), ("b", 8, 300, 2.0)),
        "eagle3": run(("a", 1, 100, 5.0), ("b", 1, 300, 15.0), ("a", 8, 100, 2.0), ("b", 8, 300, 1.0)),
        "ngram": run(("a", 1, 100, 10.0), ("b", 1, 300, 10.0), ("a", 8, 100, 4.0), ("b", 8, 300, 2.0)),
    }  # fmt: skip
    rows = {(r["set"], r["concurrency"]): r for r in speedups(runs)}
    assert list(rows) == [("a", 1), ("b", 1), ("a", 8), ("b", 8), ("all", 1), ("all", 8)]
    assert rows["a", 1]["eagle3"] == pytest.approx(2.0) and rows["b", 1]["eagle3"] == pytest.approx(
        2 / 3
    )
    assert rows["all", 1]["eagle3"] == pytest.approx((400 / 20) / (400 / 20))  # not (2 + 2/3) / 2
    assert rows["all", 8]["eagle3"] == pytest.approx((400 / 3) / (400 / 4))
    assert rows["all", 8]["ngram"] == pytest.approx((400 / 6) / (400 / 4))


def test_bench_serving_takes_the_builds_config_files_and_refuses_others(tmp_path, monkeypatch):
    """benchmarks/bench_serving.py serves with the config files the build was made with, their
    execution settings (the engine's memory, GPUs) included, which the build's record leaves out,
    from the build's working directory (relative paths resolve there, as with Snakemake's
    --directory); files whose evaluate settings are not the recorded ones (the dtype an auto
    dtype resolves to included), or no build, are refused. Sets known by name (the demo's
    held-out prompts here) are at their place, as the rules record and read them. A working
    directory without a config.yaml was built over the project's."""
    import json
    import shutil

    import yaml

    from benchmarks.bench_serving import build_config
    from workflow_scripts.lib.data.resolve import resolve_sources
    from workflow_scripts.lib.dryrun import resolved_config
    from workflow_scripts.lib.workflow.config import load_config_files
    from workflow_scripts.lib.workflow.layout import Layout

    root = Path(__file__).resolve().parents[1]
    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    (work / "verifier").mkdir(parents=True)
    elsewhere.mkdir()
    verifier_cfg = {"hidden_size": 8, "num_hidden_layers": 2, "vocab_size": 32}
    verifier_cfg["torch_dtype"] = "float16"
    (work / "verifier" / "config.json").write_text(json.dumps(verifier_cfg))
    shutil.copy(root / "config.yaml", work / "config.yaml")
    (elsewhere / "mine.yaml").write_text(
        "verifier: verifier\n"
        "evaluate:\n  use_gpus: true\n  gpu_memory_utilization: 0.5\n  max_new_tokens: 9\n"
    )
    mine = Path("mine.yaml")  # relative to where the benchmark is started, as to Snakemake
    monkeypatch.chdir(elsewhere)
    with pytest.raises(SystemExit, match="no build at"):
        build_config(work, [mine])
    monkeypatch.chdir(work)
    cfg = load_config_files([Path("config.yaml"), elsewhere / "mine.yaml"])
    layout = Layout(Path(cfg.results_dir))
    layout.train.draft.mkdir(parents=True)
    cfg.data.chat_data, cfg.evaluate.eval_prompts, _ = resolve_sources(  # as the rules do
        cfg.data.chat_data, cfg.evaluate.eval_prompts, layout.demo.dir, layout.sources_lock
    )
    layout.resolved_config.write_text(yaml.safe_dump(resolved_config(cfg, verifier_cfg)))
    assert yaml.safe_load(layout.resolved_config.read_text())["evaluate"]["dtype"] == "float16"

    monkeypatch.chdir(elsewhere)
    got, got_layout = build_config(work, [mine])
    assert Path.cwd() == work  # the build's relative verifier and results_dir resolve from here
    assert got.evaluate.gpu_memory_utilization == 0.5 and got.evaluate.max_new_tokens == 9
    assert [s.path for s in got.evaluate.eval_prompts.root] == [str(layout.demo.eval_prompts)]
    assert got_layout.root.resolve() == (work / cfg.results_dir).resolve()
    monkeypatch.chdir(elsewhere)
    (elsewhere / "cpu.yaml").write_text("evaluate:\n  use_gpus: false\n")
    with pytest.raises(SystemExit, match=r"\(evaluate\.dtype\)"):
        build_config(work, [mine, Path("cpu.yaml")])  # auto resolves to float32 on the CPU
    monkeypatch.chdir(elsewhere)
    with pytest.raises(SystemExit, match=r"\(evaluate\.dtype, evaluate\.max_new_tokens\)"):
        build_config(work, [])  # config.yaml alone: the CPU's dtype, another max_new_tokens
    (work / "config.yaml").unlink()  # built over the project's (bench_quality.py's runs)
    monkeypatch.chdir(elsewhere)
    assert build_config(work, [mine])[0].evaluate.max_new_tokens == 9


def reference_run(outputs: list[list[int]]) -> dict:
    """An engine's run without drafts, as acceptance.run_engine records it."""
    return {
        "engine_start_s": 1.0, "temperature": 0.0, "sampling": {"seed": 0},
        "generation_s": 2.0, "output_tokens": sum(map(len, outputs)), "num_drafts": 0.0,
        "num_draft_tokens": 0.0, "num_accepted_tokens": 0.0, "turns_served": len(outputs),
        "later_turns_too_long": 0, "mean_acceptance_length": None,
        "tokens_per_verifier_pass": 1.0, "acceptance_rate_per_position": [],
        "acceptance_histograms": [None] * len(outputs),
        "acceptance_histograms_by_context": [[None]] * len(outputs), "outputs": outputs,
    }  # fmt: skip


def test_a_draft_is_held_only_to_references_of_its_prompts_and_runs(tmp_path):
    """evaluate takes evaluate_reference's record as it is only where its engines served these
    prompts (set, id, prompt length) and these runs; otherwise it stops, saying how to make it
    again. The record keeps what each engine generated, read back as written."""
    from workflow_scripts.lib.evaluation.records import References
    from workflow_scripts.lib.evaluation.run import held_references, prompt_keys
    from workflow_scripts.lib.evaluation.speed import device_description
    from workflow_scripts.lib.workflow.code_inputs import made_by
    from workflow_scripts.lib.workflow.registry import EvaluateIO

    prompts = [
        {"set": "demo", "id": 0, "prompt_token_ids": [1, 2, 3]},
        {"set": "humaneval", "id": "HumanEval/0", "prompt_token_ids": [4, 5]},
    ]
    outputs = [[7, 8], [9]]
    refs = References(
        runs={"baseline": reference_run(outputs), "ngram": reference_run(outputs)},
        prompts=prompt_keys(prompts),
        device=device_description(False),
        made_by=made_by("evaluate_reference"),
    )
    assert "cores of" in refs.device
    io = EvaluateIO(
        verifier=tmp_path, draft=tmp_path, metrics=tmp_path / "m.jsonl",
        reference=tmp_path / "reference.json", results=tmp_path / "r.json", plot_dir=tmp_path,
    )  # fmt: skip
    refs.write(io.reference)
    greedy = [("greedy", 0.0)]
    held = held_references(io, prompts, greedy)
    assert held.runs["ngram"].outputs == outputs and held == References.read(io.reference)
    longer = [prompts[0], {**prompts[1], "prompt_token_ids": [4, 5, 6]}]
    sampled = [*greedy, ("temperature_0.7", 0.7)]
    for other, runs in ((longer, greedy), (prompts, sampled), (prompts[:1], greedy)):
        with pytest.raises(UserError, match="other prompts or runs .* --forcerun evaluate_refer"):
            held_references(io, other, runs)
