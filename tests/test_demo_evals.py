"""The demo's corpus of human-written prompts (lib/demo/evals_corpus.py): the evals registry read
as files, held-out tasks never in training, no prompt twice, spread over tasks, the same rows from
run to run, other layouts and LFS pointers skipped."""

from __future__ import annotations

import importlib.util
import json
from collections import Counter
from pathlib import Path

import pytest

import workflow_scripts.lib.demo.evals_corpus as evals_corpus
from workflow_scripts.lib.common import UserError
from workflow_scripts.lib.demo.evals_corpus import (
    PLACEHOLDER,
    EvalsCorpus,
    is_held_out,
    prompt_key,
    read_prompts,
    registry_data_dir,
)


@pytest.fixture(scope="module")
def corpus():
    return EvalsCorpus(0)


def key(messages: list[dict]) -> tuple:
    return prompt_key(tuple((m["role"], m["content"]) for m in messages))


def test_same_seed_same_rows_another_seed_others(corpus):
    again = EvalsCorpus(0)
    num, num_eval = len(corpus.train), len(corpus.held_out)
    assert again.generate_conversations(num) == corpus.generate_conversations(num)
    assert again.generate_eval_prompts(num_eval) == corpus.generate_eval_prompts(num_eval)
    other = EvalsCorpus(1)
    rows, other_rows = corpus.generate_conversations(100), other.generate_conversations(100)
    assert [r["messages"] for r in rows] != [r["messages"] for r in other_rows]
    evals, other_evals = corpus.generate_eval_prompts(100), other.generate_eval_prompts(100)
    assert [r["messages"] for r in evals] != [r["messages"] for r in other_evals]


def test_held_out_tasks_never_in_training(corpus):
    assert {r["family"] for r in corpus.generate_eval_prompts(len(corpus.held_out))} == {
        p.task for p in corpus.held_out
    }
    assert all(is_held_out(p.task) for p in corpus.held_out)
    assert not any(is_held_out(p.task) for p in corpus.train)
    held_out = {
        prompt_key(p.messages) for p in read_prompts(registry_data_dir()) if is_held_out(p.task)
    }
    rows = corpus.generate_conversations(len(corpus.train))
    assert not [r["id"] for r in rows if key(r["messages"][:-1]) in held_out]
    share = corpus.held_out_tasks / (corpus.held_out_tasks + corpus.train_tasks)
    assert 0.1 < share < 0.3, share  # about one task in five


def test_no_prompt_twice(corpus):
    train = [key(r["messages"][:-1]) for r in corpus.generate_conversations(len(corpus.train))]
    held_out = [key(r["messages"]) for r in corpus.generate_eval_prompts(len(corpus.held_out))]
    assert len(set(train)) == len(train)
    assert len(set(held_out)) == len(held_out)
    assert not set(train) & set(held_out)


def test_rows_well_formed(corpus):
    rows = corpus.generate_conversations(len(corpus.train))
    assert len({r["id"] for r in rows}) == len(rows)
    for r in rows:
        assert set(r) == {"id", "messages"}
        assert all(set(m) == {"role", "content"} for m in r["messages"])
        assert all(m["role"] in ("system", "user", "assistant") for m in r["messages"])
        assert all(isinstance(m["content"], str) for m in r["messages"])
        assert [m["role"] for m in r["messages"][-2:]] == ["user", "assistant"]
        assert r["messages"][-1]["content"].strip()
    answers = Counter(r["messages"][-1]["content"] == PLACEHOLDER for r in rows)
    assert answers[True] and answers[False]  # most rows have a reference, a few have none
    assert any(m["role"] == "assistant" for r in rows for m in r["messages"][:-1])  # multi-turn
    evals = corpus.generate_eval_prompts(len(corpus.held_out))
    assert len({r["id"] for r in evals}) == len(evals)
    for r in evals:
        assert set(r) == {"id", "family", "messages", "reference"}
        assert all(m["role"] in ("system", "user", "assistant") for m in r["messages"])
        assert all(isinstance(m["content"], str) for m in r["messages"])
        assert r["messages"][-1]["role"] == "user" and r["messages"][-1]["content"].strip()
        assert isinstance(r["reference"], str)


def test_rows_spread_over_tasks(corpus):
    assert corpus.train_tasks > 256
    assert len({p.task for p in corpus.train[:256]}) == 256
    assert [r["messages"][:-1] for r in corpus.generate_conversations(3)] == [
        [{"role": role, "content": c} for role, c in p.messages] for p in corpus.train[:3]
    ]
    per_task = Counter(p.task for p in corpus.train) + Counter(p.task for p in corpus.held_out)
    assert max(per_task.values()) == 40  # the default cap, reached
    assert len({p.task for p in corpus.held_out[:50]}) == 50


def test_too_many_rows_is_an_error_naming_how_many(corpus):
    num, num_eval = len(corpus.train), len(corpus.held_out)
    assert len(corpus.generate_conversations(num)) == num
    with pytest.raises(ValueError, match=f"only {num} training prompts"):
        corpus.generate_conversations(num + 1)
    with pytest.raises(ValueError, match=f"only {num_eval} held-out prompts"):
        corpus.generate_eval_prompts(num_eval + 1)
    assert f"{num} prompts for training" in corpus.summary()
    assert "\n" not in corpus.summary()


def chat(*messages: tuple[str, str], ideal: object = "answer") -> str:
    return json.dumps({"input": [{"role": r, "content": c} for r, c in messages], "ideal": ideal})


def write(path: Path, lines: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(line + "\n" for line in lines))


LONG = "word " * 20_000


@pytest.fixture
def registry(tmp_path: Path) -> Path:
    """A registry laid out like evals': task maps held out (and read last), beta and gamma not."""
    assert is_held_out("maps") and not is_held_out("beta") and not is_held_out("gamma")
    write(
        tmp_path / "maps/samples.jsonl",
        [
            chat(("system", "Be brief."), ("user", "Held out one?")),
            chat(("user", "In  both\ttasks?"), ideal=["", 3]),
            json.dumps({"input": "A plain string prompt.", "ideal": ["first", "second"]}),
        ],
    )
    write(
        tmp_path / "beta/samples.jsonl",
        [
            chat(("system", "S"), ("user", "Q1"), ("assistant", "A1"), ("user", "Q2"), ideal=[7]),
            chat(("user", "In both tasks?")),  # also in maps, held out: dropped from training
            chat(("system", "S"), ("user", "Q1"), ("assistant", "A1"), ("user", "Q2")),  # again
            json.dumps(
                {
                    "input": [
                        {"role": "system", "content": "Spell it backwards.", "name": None},
                        {"role": "system", "content": "abc", "name": "example_user"},
                        {"role": "system", "content": "cba", "name": "example_assistant"},
                        {"role": "user", "content": "xyz"},
                    ],
                    "ideal": "zyx",
                }
            ),
            chat(("system", "Only a system message.")),
            chat(("user", "Ends with an answer."), ("assistant", "It does.")),
            chat(("user", "A tool result?"), ("tool", "42")),
            json.dumps({"input": [{"role": "user", "content": ["not", "a", "string"]}]}),
            json.dumps({"question": "Another layout", "answer": "skipped"}),
            json.dumps(["not", "an", "object"]),
            "not JSON {",
        ],
    )
    write(tmp_path / "beta/more/long.jsonl", [chat(("user", LONG), ideal="")])
    write(tmp_path / "gamma/samples.jsonl", [chat(("user", f"Gamma {i}?")) for i in range(3)])
    write(
        tmp_path / "gamma/pointer.jsonl",
        ["version https://git-lfs.github.com/spec/v1", "size 170626821", chat(("user", "LFS?"))],
    )
    write(tmp_path / "stray.jsonl", [chat(("user", "Not in a task directory."))])
    return tmp_path


def test_registry_layouts_read(registry):
    read = read_prompts(registry)
    prompts = {(p.task, p.messages[-1][1]): p for p in read}
    assert sorted((p.task, p.messages[-1][1]) for p in read) == [
        ("beta", "In both tasks?"),
        ("beta", "Q2"),
        ("beta", "Q2"),
        ("beta", LONG),
        ("beta", "xyz"),
        ("gamma", "Gamma 0?"),
        ("gamma", "Gamma 1?"),
        ("gamma", "Gamma 2?"),
        ("maps", "A plain string prompt."),
        ("maps", "Held out one?"),
        ("maps", "In  both\ttasks?"),
    ]
    assert prompts["maps", "A plain string prompt."].messages == (
        ("user", "A plain string prompt."),
    )
    assert prompts["maps", "A plain string prompt."].reference == "first"
    assert prompts["maps", "In  both\ttasks?"].reference == ""
    assert prompts["beta", "Q2"].messages == (
        ("system", "S"),
        ("user", "Q1"),
        ("assistant", "A1"),
        ("user", "Q2"),
    )
    assert [role for role, _ in prompts["beta", "xyz"].messages] == [
        "system",
        "user",
        "assistant",
        "user",
    ]
    assert prompts["beta", LONG].reference == ""


def test_duplicates_and_held_out_copies_dropped(registry):
    for seed in range(5):
        corpus = EvalsCorpus(seed, max_prompts_per_task=1, data_dir=registry)
        assert [p.task for p in corpus.held_out] == ["maps"]
        assert sorted(p.task for p in corpus.train) == ["beta", "gamma"]
        assert not any("both" in p.messages[-1][1] for p in corpus.train)
    corpus = EvalsCorpus(0, data_dir=registry)
    assert len(corpus.held_out) == 3
    rows = corpus.generate_conversations(len(corpus.train))
    assert sorted(r["messages"][-2]["content"] for r in rows) == sorted(
        [LONG, "Q2", "xyz", "Gamma 0?", "Gamma 1?", "Gamma 2?"]
    )
    answers = {r["messages"][-2]["content"]: r["messages"][-1]["content"] for r in rows}
    assert answers[LONG] == PLACEHOLDER and answers["Q2"] == PLACEHOLDER
    assert answers["xyz"] == "zyx"


def test_lines_read_are_bounded(registry, monkeypatch):
    monkeypatch.setattr(evals_corpus, "MAX_LINES", 2)
    tasks = Counter(p.task for p in read_prompts(registry))
    assert tasks == {"maps": 2, "beta": 3, "gamma": 2}  # beta: 2 of samples.jsonl, 1 of more/long


def test_missing_package_is_a_user_error(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(UserError, match="'evals'.*make venv.*requirements-data-packages.txt"):
        EvalsCorpus(0)
