"""The quality benchmark's natural-text corpus (lib/demo/docs.py): prose only, held-out documents
never in training, the same bytes from run to run, errors that name the key."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import ROOT
from workflow_scripts.lib.common import UserError
from workflow_scripts.lib.demo.docs import DocsCorpus, is_prose, read_documents, split_opening

PACKAGES = ["networkx"]  # installed by the lock; about a second to read


@pytest.fixture(scope="module")
def corpus():
    return DocsCorpus(0, PACKAGES)


def test_prose_filter():
    text = (
        "Return the shortest path between two nodes of a graph, measured by the number of "
        "edges on it, or by the sum of their weights when a weight attribute is named here."
    )
    assert is_prose(text)
    assert not is_prose("Parameters ---------- G : graph A NetworkX graph whose edges are read.")
    assert not is_prose(text[:100])  # too short
    assert not is_prose(">>> G = nx.path_graph(4) " + text)
    assert not is_prose("x = [1, 2, 3] + [4, 5, 6] * 7 / 8 - (9 ** 10) % 11 " * 4)


def test_opening_and_rest_make_the_paragraph():
    import random

    paragraph = "The first sentence ends here. The second one goes on. A third closes it."
    opening, rest = split_opening(paragraph, random.Random(0))
    assert (opening, rest) == (
        "The first sentence ends here.",
        "The second one goes on. A third closes it.",
    )
    single = "one long sentence without any full stop that goes on and on for many words"
    opening, rest = split_opening(single, random.Random(0))
    assert f"{opening} {rest}" == single and opening and len(rest.split()) >= 4


def test_held_out_documents_never_reach_training(corpus):
    rows = corpus.generate_conversations(300)
    train_text = "\n".join(m["content"] for r in rows for m in r["messages"])
    held_out = {p for d in corpus.held_out for p in d.paragraphs}
    assert held_out and not any(p in train_text for p in held_out)
    for row in corpus.generate_eval_prompts(20):
        assert [m["role"] for m in row["messages"]] == ["system", "user"]
        assert row["reference"] and row["reference"] not in train_text
    # every paragraph is used once in the whole corpus
    paragraphs = [p for d in corpus.train + corpus.held_out for p in d.paragraphs]
    assert len(paragraphs) == len(set(paragraphs))


def test_conversations_alternate_and_answer_from_the_text(corpus):
    for row in corpus.generate_conversations(50):
        roles = [m["role"] for m in row["messages"]]
        assert roles[0] == "system" and roles[1::2] == ["user"] * (len(roles) // 2)
        assert roles[2::2] == ["assistant"] * (len(roles) // 2)
        assert all(m["content"].strip() for m in row["messages"])


def test_same_seed_same_bytes_other_seed_other_order(corpus):
    again = DocsCorpus(0, PACKAGES)
    dump = json.dumps(corpus.generate_conversations(100))
    assert dump == json.dumps(again.generate_conversations(100))
    assert json.dumps(corpus.generate_eval_prompts(10)) == json.dumps(
        again.generate_eval_prompts(10)
    )
    assert dump != json.dumps(DocsCorpus(1, PACKAGES).generate_conversations(100))


def test_the_stream_goes_on_past_one_pass(corpus):
    n = len(corpus.train) + 5
    rows = corpus.generate_conversations(n)
    assert len(rows) == n and len({r["id"] for r in rows}) == n


def test_errors_name_the_key():
    with pytest.raises(UserError, match="demo.corpus_packages.*not_a_package_here"):
        read_documents(["not_a_package_here"])
    with pytest.raises(ValueError, match="held-out documents"):
        DocsCorpus(0, PACKAGES).generate_eval_prompts(10**6)


def test_demo_stage_builds_a_docs_verifier_and_data(tmp_path):
    """The real demo script with corpus package_docs, small: data from the corpus, a verifier
    that loads, its report with the held-out loss."""
    from tests.conftest import TINY_VERIFIER, run_demo

    build = run_demo(
        tmp_path,
        corpus="package_docs",
        corpus_packages=PACKAGES,
        num_conversations=30,
        num_eval_prompts=4,
        **TINY_VERIFIER,
        train_steps=2,
        train_batch_size_samples=4,
    )
    rows = [json.loads(x) for x in Path(build["chat_data"]).read_text().splitlines()]
    assert rows == DocsCorpus(0, PACKAGES).generate_conversations(30)
    report = json.loads((Path(build["verifier"]) / "demo_report.json").read_text())
    assert report["eval"]["held_out_tokens"] > 0 and report["eval"]["held_out_loss"] > 0


def test_quality_config_plans_every_stage(tmp_path):
    import yaml

    from tests.workflow_runner import copy_workflow, planned

    config = yaml.safe_load((ROOT / "config.quality.yaml").read_text())
    work = copy_workflow(tmp_path / "work", config)
    plan = planned(work, "evaluate")
    assert {"demo", "prepare", "extract", "vocab", "train", "evaluate_draft"} <= set(plan), plan


def test_every_quality_variant_is_a_valid_config():
    """Each variant of benchmarks/bench_quality.py, over config.yaml and its benchmark's config
    (config.quality.yaml, or config.long.yaml for the long benchmark's) as the benchmark layers
    them, passes the config's checks (a misspelt setting would fail a run hours into the
    benchmark)."""
    import yaml

    from benchmarks.bench_quality import AGAINST, BENCHES, DEFAULT, SOURCE, SOURCES, VARIANTS
    from workflow_scripts.lib.workflow.config import load_config

    def merged(base: dict, over: dict) -> dict:
        out = dict(base)
        for key, value in over.items():
            is_section = isinstance(value, dict) and isinstance(out.get(key), dict)
            out[key] = merged(out[key], value) if is_section else value
        return out

    long = BENCHES["long"][2]
    assert set(DEFAULT) <= set(VARIANTS) and set(long) <= set(VARIANTS)
    assert set(AGAINST) | set(AGAINST.values()) <= set(VARIANTS)  # paired against a variant
    for bench, (configfile, _, _) in BENCHES.items():
        base = merged(*(yaml.safe_load(f.read_text()) for f in (ROOT / "config.yaml", configfile)))
        names = (
            long if bench == "long" else [v for v in VARIANTS if v == "baseline" or v not in long]
        )
        for name, (_, settings) in [*((v, VARIANTS[v]) for v in names), *SOURCES.items()]:
            cfg = load_config(
                merged(base, {**settings, "train": {**settings.get("train", {}), "seed": 2}})
            )
            assert cfg.train.seed == 2, name
            source = (cfg.train.init_from or "").removeprefix(SOURCE)
            assert source == (cfg.train.init_from or "") or source in SOURCES, name


def test_quality_runs_are_kept_by_the_code_and_the_build_that_made_them(tmp_path):
    """A run's record (benchmarks/results/quality/<variant>@<seed>.json) counts as done only for
    the code that made it and the build it was computed from: a record whose stages'
    fingerprints differ, or whose verifier or chat data differ from this build's, is left out
    (and run again); records of two different builds of the shared stages are refused, naming
    them."""
    from benchmarks.bench_quality import RUN_STAGES, code_now, load_runs, record, table

    hist = [[1, 0, 2, 3], [0, 1, 1, 4]]
    by_context = [[[1, 0, 1, 1], [0, 0, 1, 2]], [[0, 1, 0, 2], [0, 0, 1, 2]]]  # 2 buckets each
    results = {
        "summary": {
            "eagle3_mean_acceptance_length": 3.0, "eagle3_mean_acceptance_length_ci95": [2.8, 3.2],
            "eagle3_simulated_acceptance_length": 3.1, "ngram_mean_acceptance_length": 1.5,
            "eagle3_over_ngram": 2.0,
        },
        "made_by": {"code": "c", "versions": {}}, "num_prompts": 2, "max_new_tokens": 8,
        "num_speculative_tokens": 3, "prompts": ["not kept"], "context_edges_tokens": [256, 512],
        "runs": {
            "eagle3": {"acceptance_rate_per_position": [0.9, 0.8, 0.7],
                       "acceptance_histograms": hist, "per_prompt": {},
                       "acceptance_histograms_by_context": by_context},
            "ngram": {"per_prompt": {"mean_acceptance_length_ci95": [1.4, 1.6]},
                      "acceptance_histograms": hist,
                      "acceptance_histograms_by_context": by_context},
        },
        "sets": {"demo": {"num_prompts": 1, "eagle3": {}}, "humaneval": {"num_prompts": 1}},
    }  # fmt: skip
    code = code_now()
    assert set(code) == set(RUN_STAGES) and "demo" not in code  # the demo is held by its bytes
    assert code["train"] != code["extract"] and len(code["train"]) == 64
    build = {"verifier": "v", "chat_data": "c"}

    def keep(variant, seed, **changes):
        facts = dict(variant=variant, seed=seed, settings={}, code=code, build=build,
                     cpu_capability="AVX512", wall_s=60, train_evaluate_s=50, lanes=1)  # fmt: skip
        rec = record(results, **{**facts, **changes})
        (tmp_path / f"{variant}@{seed}.json").write_text(json.dumps(rec))
        return rec

    assert "prompts" not in keep("baseline", 0)["results"]
    keep("qwen3_layer", 0)
    keep("qwen3_layer", 1, code={**code, "train": "0" * 64})  # older training code
    for held_to in (None, build):
        done, stale = load_runs(tmp_path, code, held_to)
        assert {v: list(s) for v, s in done.items()} == {"baseline": [0], "qwen3_layer": [0]}
        assert stale == ["qwen3_layer@1"]
    assert "| qwen3_layer |" in table(done) and "+0.000" in table(done)
    # by context length: each bucket pooled over prompts (the second: 1 + 16 accepted / 6
    # steps), the last over the first
    assert "| variant | 0-256 | 256-512 | last / first |" in table(done)
    assert "| baseline | 3.000 | 3.667 | 1.22 |" in table(done)
    assert "| qwen3_layer | 3.000 +0.000 [+0.000, +0.000] | 3.667 +0.000" in table(done)
    # per evaluation set: its prompts' rows pooled (prompt 0: 1 + 13 accepted / 6 steps)
    assert "| variant | demo (1) | humaneval (1) |" in table(done)
    assert "| baseline | 3.167 | 3.500 |" in table(done)
    # n-gram in tokens a verifier pass (its histograms here EAGLE-3's): prompt 0 outputs 6
    # steps + 13 accepted + 1 = 20 tokens in 20 - 13 passes, prompt 1 6 + 15 + 1 in 22 - 15
    assert "| n-gram, output tokens a verifier pass | 2.857 | 3.143 |" in table(done)
    assert "n-gram drafted at 12 verify steps, EAGLE-3 at 12 (every one)" in table(done)
    assert "gives 3.000." in table(done) and "a verifier pass 3.000 tokens, 1.000x" in table(done)
    assert "| qwen3_layer | 3.167 +0.000 [+0.000, +0.000] | 3.500 +0.000" in table(done)
    done, stale = load_runs(tmp_path, code, {**build, "verifier": "w"})  # this build's verifier
    assert done == {} and len(stale) == 3

    keep("qwen3_layer", 1, build={**build, "chat_data": "d"})  # kept from another build
    with pytest.raises(SystemExit, match="from 2 builds .* chat_data .* qwen3_layer@1"):
        load_runs(tmp_path, code)
    done, stale = load_runs(tmp_path, code, build)  # held to this build: left out, run again
    assert stale == ["qwen3_layer@1"]
    (tmp_path / "qwen3_layer@1.json").unlink()

    # a corpus of its own: held to the build's verifier, not to its chat data
    keep("real_corpus_4000", 0, build={**build, "chat_data": "own"})
    for held_to in (None, build):
        done, stale = load_runs(tmp_path, code, held_to)
        assert list(done["real_corpus_4000"]) == [0] and stale == []
    keep("real_corpus_4000", 1, build={"verifier": "w", "chat_data": "own"})
    assert "real_corpus_4000@1" in load_runs(tmp_path, code, build)[1]
    with pytest.raises(SystemExit, match="from 2 builds .* verifier .* real_corpus_4000@1"):
        load_runs(tmp_path, code)

    # a variant paired against another than the baseline (AGAINST): its cells and captions say so
    keep("real_epochs_10", 0)
    keep("real10_eagle3.1_norms", 0)
    text = table(load_runs(tmp_path, code, build)[0])
    assert "| 3.100 | vs real_epochs_10: +0.000 [+0.000, +0.000] | no |" in text
    assert text.count("against the baseline (real10_eagle3.1_norms against real_epochs_10)") == 2


def test_a_run_on_part_of_the_cores_counts_that_part_of_its_time(monkeypatch):
    """A run given 1 of 2 cores (beside another run, or a lane of 2) takes about twice as long as
    alone: the table's time per run counts half of it. Records from before the share was kept
    count 1 / their lanes."""
    from benchmarks import bench_quality

    monkeypatch.setattr(bench_quality.os, "cpu_count", lambda: 2)
    assert [bench_quality.machine_share(c) for c in ("1", "2", "all", "4")] == [0.5, 1, 1, 1]
    results = {
        "summary": {"eagle3_mean_acceptance_length": 2.0, "eagle3_simulated_acceptance_length": 2,
                    "ngram_mean_acceptance_length": 1.0, "eagle3_over_ngram": 2.0,
                    "eagle3_mean_acceptance_length_ci95": [1, 3]},
        "num_prompts": 1, "max_new_tokens": 8, "num_speculative_tokens": 3,
        "runs": {"eagle3": {"acceptance_rate_per_position": [0.5],
                            "acceptance_histograms": [[1, 1]]},
                 "ngram": {"per_prompt": {"mean_acceptance_length_ci95": [1, 1]},
                           "acceptance_histograms": [[1, 1]]}},
    }  # fmt: skip
    run = dict(results=results, wall_s=7200, stages_s=3600, lanes=1)
    alone, one_core, old_lane = {**run, "share": 1.0}, {**run, "share": 0.5}, {**run, "lanes": 2}
    # (3600 + 1800 + 1800) / 3 = 2400 s a run; (7200 + 3600 + 3600) s = 4 h in all
    text = bench_quality.table({"baseline": {0: alone, 1: one_core}, "ttt_5": {0: old_lane}})
    assert "3 runs, 4.0 h in all" in text and "(training and evaluation: 40 minutes a run" in text


def test_tokens_a_verifier_pass_count_the_steps_n_gram_did_not_draft():
    """vLLM's acceptance length counts only the steps that drafted; n-gram drafts only where it
    finds a match. Tokens a forward pass of the verifier count the others too: the output is
    EAGLE-3's steps, their accepted drafts and each prompt's prefill token."""
    from benchmarks.bench_quality import per_pass, pooled_length

    eagle3 = np.array([[2, 1, 0, 0], [1, 0, 0, 1]], dtype=float)  # 5 steps, 4 accepted
    ngram = np.array([[0, 0, 0, 1], [0, 0, 1, 0]], dtype=float)  # 2 steps, 5 accepted
    # output: 2 + 2 + 1 and 1 + 4 + 1 = 11 tokens; the verifier's passes: 11 - 4 and 11 - 5
    assert per_pass(eagle3, eagle3) == pytest.approx(11 / 7)
    assert per_pass(eagle3, ngram) == pytest.approx(11 / 6)
    assert float(pooled_length([ngram])) == pytest.approx(3.5)  # vLLM's figure: 1 + 5 / 2


def test_prompts_whose_text_repeats_are_those_n_gram_drafts_at_half_the_passes_or_more():
    """The table of fresh and repeating text splits the prompts by the share of the verifier's
    passes at which n-gram found a match to draft from (REPEATS), and gives each group's
    acceptance length and n-gram's tokens a verifier pass; with one group empty, no table."""
    from benchmarks.bench_quality import repeat_table, repeats

    results = {
        "num_speculative_tokens": 3,
        "runs": {
            "eagle3": {"acceptance_histograms": [[2, 1, 0, 0], [1, 0, 0, 1]]},  # 5 and 6 tokens
            # 1 drafted step of 5 passes (1 / 5: fresh); 2 drafted of 6 - 3 passes (2 / 3)
            "ngram": {"acceptance_histograms": [[1, 0, 0, 0], [1, 0, 0, 1]]},
        },
    }
    assert repeats(results).tolist() == [False, True]
    text = "\n".join(repeat_table({"baseline": {0: {"results": results}}}))
    assert "| variant | fresh text (1) | repeating text (1) |" in text
    assert "| baseline | 1.333 | 2.500 |" in text  # 1 + 1 / 3 and 1 + 3 / 2
    assert "| n-gram | 1.000 | 2.500 |" in text
    assert "| n-gram, output tokens a verifier pass | 1.000 | 2.000 |" in text  # 5 / 5, 6 / 3
    results["runs"]["ngram"]["acceptance_histograms"][0] = [2, 0, 0, 1]  # 3 of 5 - 3 passes
    assert repeats(results).tolist() == [True, True]
    assert repeat_table({"baseline": {0: {"results": results}}}) == []


def test_a_table_of_stale_runs_only_leaves_the_kept_table(tmp_path):
    """When no kept record counts for this code, --table says so and leaves the kept table.md
    as it is (the repository's copy of the last results), rather than emptying it."""
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "table.md").write_text("the last results\n")
    stale = {"variant": "baseline", "seed": 0, "code": {"train": "0" * 64}, "build": {}}
    (kept / "baseline@0.json").write_text(json.dumps(stale))
    proc = subprocess.run(
        [sys.executable, "benchmarks/bench_quality.py", "--table", "--kept", str(kept),
         "--workdir", str(tmp_path / "work")],
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "its table.md is left as it is" in proc.stdout
    assert (kept / "table.md").read_text() == "the last results\n"
