"""The long-context benchmark's corpus (lib/demo/long_docs.py): answers that are in the passage,
held-out documents never in training, evaluation prompts spread over the lengths, the same
bytes from run to run, errors that name the key; and the demo stage building a verifier of the
configured maximum length."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import ROOT
from workflow_scripts.lib.common import UserError
from workflow_scripts.lib.demo.long_docs import LongDocsCorpus

PACKAGES = ["networkx"]  # installed by the lock; about a second to read
CHARS = (300, 6000)


@pytest.fixture(scope="module")
def corpus():
    return LongDocsCorpus(0, PACKAGES, CHARS)


def test_every_answer_is_in_the_passage(corpus):
    for row in corpus.generate_conversations(60):
        roles = [m["role"] for m in row["messages"]]
        assert roles[0] == "system" and roles[1:] == ["user", "assistant"] * (len(roles) // 2)
        passage = row["messages"][1]["content"]
        answers = [m["content"] for m in row["messages"][2::2]]
        assert answers and all(a and a in passage for a in answers)


def test_passages_reach_their_lengths_and_held_out_stays_out(corpus):
    rows = corpus.generate_conversations(200)
    lengths = [len(r["messages"][1]["content"]) for r in rows]
    assert CHARS[0] <= min(lengths) < 2 * CHARS[0] and max(lengths) > CHARS[1] / 2
    train_text = "\n".join(r["messages"][1]["content"] for r in rows)
    held_out = {p for run in corpus.held_out for d in run for p in d.paragraphs}
    assert held_out and not any(p in train_text for p in held_out)
    prompts = corpus.generate_eval_prompts(24)
    for row in prompts:
        assert [m["role"] for m in row["messages"]] == ["system", "user"]
        assert row["reference"] in row["messages"][1]["content"]
        assert any(row["reference"] in p for p in held_out)
    # spread over the log of the length: the shortest first, the longest last
    sizes = [len(r["messages"][1]["content"]) for r in prompts]
    assert sizes[0] < 3 * CHARS[0] and sizes[-1] > CHARS[1] * 0.8
    assert sizes[len(sizes) // 2] < sizes[-1] / 3


def test_same_seed_same_bytes_other_seed_other_data(corpus):
    dump = json.dumps(corpus.generate_conversations(30) + corpus.generate_eval_prompts(8))
    again = LongDocsCorpus(0, PACKAGES, CHARS)
    assert dump == json.dumps(again.generate_conversations(30) + again.generate_eval_prompts(8))
    assert dump != json.dumps(LongDocsCorpus(1, PACKAGES, CHARS).generate_conversations(30))


def test_errors_name_the_key():
    with pytest.raises(UserError, match=r"demo.long_docs_chars \[300, 100000000\].*networkx"):
        LongDocsCorpus(0, PACKAGES, (300, 10**8))
    from workflow_scripts.lib.workflow.definitions import DemoParams

    with pytest.raises(ValueError, match=r"long_docs_chars \[900, 300\]"):
        DemoParams(long_docs_chars=(900, 300))


def test_demo_stage_builds_a_long_context_verifier(tmp_path):
    """The real demo script with corpus long_docs, small: the verifier's maximum length is the
    setting's, and a conversation past it stops the stage, naming the setting."""
    from tests.conftest import TINY_VERIFIER, run_demo

    params = dict(
        corpus="long_docs",
        corpus_packages=PACKAGES,
        long_docs_chars=(200, 2500),
        num_conversations=20,
        num_eval_prompts=4,
        **TINY_VERIFIER,
        max_position_embeddings=4096,
        prompt_loss_weight=1.0,
        train_steps=2,
        train_batch_size_samples=4,
    )
    build = run_demo(tmp_path / "ok", **params)
    config = json.loads((Path(build["verifier"]) / "config.json").read_text())
    assert config["max_position_embeddings"] == 4096
    rows = [json.loads(x) for x in Path(build["chat_data"]).read_text().splitlines()]
    assert rows == LongDocsCorpus(0, PACKAGES, (200, 2500)).generate_conversations(20)
    with pytest.raises(AssertionError, match=r"past the verifier's maximum length \(demo.max_pos"):
        run_demo(tmp_path / "short", **{**params, "max_position_embeddings": 256})


def test_long_config_plans_every_stage(tmp_path):
    import yaml

    from tests.workflow_runner import copy_workflow, planned

    config = yaml.safe_load((ROOT / "config.long.yaml").read_text())
    work = copy_workflow(tmp_path / "work", config)
    plan = planned(work, "evaluate")
    assert {"demo", "regenerate", "prepare", "extract", "train", "evaluate_draft"} <= set(plan)
