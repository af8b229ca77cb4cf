"""regenerate: the verifier's own answers to the chat data's user turns, with real vLLM.

Fast tests: where answers go, bad input found before the model loads, the batch files a restart
reuses. Tests marked ``slow`` run the script on the full-size demo verifier (``demo_build``):
the answers are the verifier's, limits are counted and flagged, a killed job resumes.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from tests.bad_rows import EVERY_BAD_ROW, refusing_tokenizer
from tests.conftest import ROOT
from tests.processes import kill_when
from tests.stage_process import run_stage
from tests.tokenizers_for_tests import build_chatml_tokenizer
from workflow_scripts.lib.chat.tokenization import read_conversation, tokenize_rows
from workflow_scripts.lib.chat.rows import BadRow
from workflow_scripts.lib.chat.template import ChatTemplate
from workflow_scripts.lib.common import UserError
from workflow_scripts.lib.regeneration import answers as regeneration
from workflow_scripts.lib.regeneration import run as regeneration_run
from workflow_scripts.lib.regeneration.records import AnswerBatch, AnswerCounts, RegeneratePart
from workflow_scripts.lib.workflow import cli
from workflow_scripts.lib.workflow.config import load_config
from workflow_scripts.lib.workflow.definitions import RegenerateParams
from workflow_scripts.stages import regenerate, regenerate_merge
from workflow_scripts.lib.workflow.layout import STATS

S = {"role": "system", "content": "Be brief."}


def U(text: str) -> dict:
    return {"role": "user", "content": text}


def A(text: str) -> dict:
    return {"role": "assistant", "content": text}


CALL = {
    "role": "assistant",
    "content": "",
    "tool_calls": [{"id": "c0", "name": "f", "arguments": {}}],
}
RESULT = {"role": "tool", "content": "42", "tool_call_id": "c0"}

# --------------------------------------------------------------------------- where answers go


@pytest.mark.parametrize(
    "messages, expected",
    [
        ([S, U("a"), A("x")], [S, U("a"), None]),
        ([U("a"), A("x"), U("b"), A("y")], [U("a"), None, U("b"), None]),
        # a last user turn gets an answer too
        ([U("a"), A("x"), U("b")], [U("a"), None, U("b"), None]),
        ([S, U("a")], [S, U("a"), None]),
        # two user turns in a row: one answer, after the second
        ([U("a"), U("b"), A("x")], [U("a"), U("b"), None]),
        # an assistant message that follows no user turn is left out
        ([A("hello"), U("a"), A("x"), A("more")], [U("a"), None]),
        # from the first tool call on, the conversation is kept as it is
        (
            [U("a"), A("x"), U("b"), CALL, RESULT, A("y")],
            [U("a"), None, U("b"), CALL, RESULT, A("y")],
        ),
        ([S, U("b"), CALL, RESULT, A("y")], [S, U("b"), CALL, RESULT, A("y")]),
    ],
)
def test_answer_plan(messages, expected):
    assert regeneration.answer_plan(messages) == expected


def test_conversation_without_user_turn_is_a_bad_row():
    with pytest.raises(BadRow) as exc:
        regeneration.answer_plan([S, A("x")])
    assert exc.value.reason == "no_user_turn"


def test_conversation_replays_plan_with_its_own_answers():
    conv = regeneration.Conversation(
        "c", 1, "chats.jsonl:1", regeneration.answer_plan([S, U("a"), A("x"), U("b"), A("y")])
    )
    assert conv.next_prompt() == [S, U("a")]
    conv.messages.append(A("mine"))
    assert conv.next_prompt() == [S, U("a"), A("mine"), U("b")]
    conv.messages.append(A("mine too"))
    assert conv.next_prompt() is None


def test_context_full_ends_at_last_answer():
    conv = regeneration.Conversation(
        "c", 1, "chats.jsonl:1", regeneration.answer_plan([U("a"), A("x"), U("b"), A("y")])
    )
    conv.next_prompt()
    conv.messages.append(A("mine"))
    conv.next_prompt()  # [a, mine, b]: does not fit
    conv.finish()
    assert conv.messages == [U("a"), A("mine")] and conv.context_full


def test_turn_seed_depends_on_seed_row_and_turn_only():
    seeds = {regeneration.turn_seed(s, line, t) for s in (0, 1) for line in (1, 2) for t in (0, 1)}
    assert len(seeds) == 8
    assert regeneration.turn_seed(0, 5, 2) == regeneration.turn_seed(0, 5, 2)


# --------------------------------------------------------------------------- before the model loads


@pytest.fixture(scope="module")
def chatml_verifier(tmp_path_factory):
    """A ChatML tokenizer and a config; its weight file is a placeholder (never loaded here)."""
    path = build_chatml_tokenizer(tmp_path_factory.mktemp("chatml") / "verifier")
    vocab = len(AutoTokenizer.from_pretrained(path))
    (path / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "hidden_size": 64,
                "num_hidden_layers": 4,
                "num_attention_heads": 2,
                "num_key_value_heads": 1,
                "vocab_size": vocab,
            }
        )
    )
    (path / "model.safetensors").write_bytes(b"never loaded by these tests")
    return path


def test_stop_tokens_of_chatml(chatml_verifier):
    tok = AutoTokenizer.from_pretrained(chatml_verifier)
    assert ChatTemplate(tok).stop_ids == [tok.convert_tokens_to_ids("<|im_end|>")]


def args_for(verifier: Path, chat: Path, out: Path, job_index: int = 0, **overrides) -> list[str]:
    """The command line of regenerate job ``job_index``, writing under ``out``."""
    cfg = load_config(
        {
            "regenerate": {
                "use_gpus": False,
                "enforce_eager": True,
                "dtype": "float32",
                "max_model_len_tokens": 1024,
                "kv_cache_memory_bytes": 1 << 28,
                **overrides,
            }
        }
    )
    files = {
        "chat_data": chat,
        "verifier": verifier,
        "work_dir": out / "batches",
        "job_index": job_index,
        "part": out / "parts" / f"part_{job_index}.json",
    }
    return shlex.split(cli.render("regenerate", cfg.regenerate, files))


def merge_args(out: Path, num_jobs: int = 1) -> list[str]:
    files = {
        "parts": [out / "parts" / f"part_{j}.json" for j in range(num_jobs)],
        "work_dir": out / "batches",
        "regenerated": out / "chat_data.jsonl",
        "stats": out / STATS,
    }
    return shlex.split(cli.render("regenerate_merge", None, files))


def main_error(monkeypatch, verifier: Path, chat: Path, tmp_path: Path, **overrides) -> str:
    """Runs the script's main in-process; returns its UserError. The engine must not start."""

    def no_engine(*a, **k):
        raise AssertionError("the engine was started before the input was checked")

    monkeypatch.setattr(regeneration_run, "make_engine", no_engine)
    monkeypatch.setattr(
        sys, "argv", ["regenerate", *args_for(verifier, chat, tmp_path, **overrides)]
    )
    with pytest.raises(UserError) as exc:
        regenerate.main()
    return str(exc.value)


def write_chat(path: Path, lines: list) -> Path:
    path.write_text(
        "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines)
    )
    return path


GOOD = {"messages": [U("Count from 1 to 3."), A("1, 2, 3.")]}


@pytest.mark.parametrize(
    "bad, reason",
    [
        ("{not json", "not valid JSON"),
        ({"messages": [{"role": "robot", "content": "beep"}]}, "role 'robot'"),
        ({"messages": []}, "no messages"),
        ({"messages": [S, A("x")]}, "no user turn"),
        ({"text": "hello"}, "neither 'messages' nor 'conversations'"),
    ],
)
def test_bad_row_fails_with_file_and_line_before_the_model_loads(
    monkeypatch, chatml_verifier, tmp_path, bad, reason
):
    chat = write_chat(tmp_path / "chat.jsonl", [GOOD, GOOD, bad, GOOD])
    msg = main_error(monkeypatch, chatml_verifier, chat, tmp_path)
    assert f"{chat}:3" in msg and reason in msg and "regenerate.on_bad_row: skip" in msg, msg


def test_too_long_first_prompt_fails_before_the_model_loads(monkeypatch, chatml_verifier, tmp_path):
    chat = write_chat(tmp_path / "chat.jsonl", [GOOD, {"messages": [U("fox " * 300), A("x")]}])
    msg = main_error(monkeypatch, chatml_verifier, chat, tmp_path, max_model_len_tokens=64)
    assert f"{chat}:2" in msg and "regenerate.max_model_len_tokens (64)" in msg, msg


def test_bad_rows_skipped_and_counted_by_reason(tmp_path):
    chat = write_chat(
        tmp_path / "chat.jsonl",
        [
            GOOD,
            "{not json",
            "",
            {"messages": [S, A("x")]},
            {"conversations": [{"from": "human", "value": "hi"}]},
        ],
    )
    index = regeneration.index_input(chat, RegenerateParams(on_bad_row="skip"))
    assert index.rows_in == 4  # the blank line is not a row
    assert dict(index.bad) == {"malformed": 1, "no_user_turn": 1}
    assert list(index.line_nos) == [1, 5]
    with open(chat, "rb") as fh:
        fh.seek(index.offsets[1])
        assert json.loads(fh.readline())["conversations"][0]["value"] == "hi"


def test_no_usable_row_and_missing_file_are_clear_errors(monkeypatch, chatml_verifier, tmp_path):
    empty = write_chat(tmp_path / "empty.jsonl", [])
    msg = main_error(monkeypatch, chatml_verifier, empty, tmp_path, on_bad_row="skip")
    assert "no usable conversation among 0 rows" in msg
    msg = main_error(monkeypatch, chatml_verifier, tmp_path / "nope.jsonl", tmp_path)
    assert "does not exist" in msg and "chat_data" in msg


def test_tensor_parallel_size_is_checked_before_the_model_loads(
    monkeypatch, chatml_verifier, tmp_path
):
    chat = write_chat(tmp_path / "chat.jsonl", [GOOD])
    msg = main_error(monkeypatch, chatml_verifier, chat, tmp_path, tensor_parallel_size=3)
    assert "regenerate.tensor_parallel_size 3 does not divide" in msg


def empty_batch(key: str) -> AnswerBatch:
    return AnswerBatch(fingerprint=key, rows=[], stats=AnswerCounts(), bad={})


def test_restart_keeps_finished_batches_of_the_same_run_only(tmp_path):
    work = tmp_path / "batches"
    work.mkdir()
    empty_batch("same").write(work / "batch-000000.json")
    empty_batch("other").write(work / "batch-000001.json")
    (work / "batch-000002.json").write_text('{"fingerprint": "same", "ro')  # cut short
    empty_batch("same").write(work / "batch-000003.json")
    (work / ".batch-000004.json.tmp-123").write_text("partial")
    empty_batch("same").write(work / "batch-000009.json")
    done = regeneration.clean_work_dir(work, ["same"] * 5)
    assert done == [0, 3]
    assert sorted(p.name for p in work.iterdir()) == ["batch-000000.json", "batch-000003.json"]


def test_a_job_judges_only_its_own_batch_files(tmp_path):
    """Job 1 of 2 keeps its finished batches and removes its partial one; job 0's files, even a
    partial one it may be writing right now, are left alone."""
    work = tmp_path / "batches"
    work.mkdir()
    for b in range(4):
        empty_batch("same").write(work / f"batch-{b:06d}.json")
    (work / ".batch-000004.json.tmp-11").write_text("job 0 writing")
    (work / ".batch-000005.json.tmp-12").write_text("job 1, killed")
    empty_batch("old").write(work / "batch-000003.json")
    done = regeneration.clean_work_dir(work, ["same"] * 6, job_index=1, num_jobs=2)
    assert done == [1]
    assert sorted(p.name for p in work.iterdir()) == [
        ".batch-000004.json.tmp-11", "batch-000000.json", "batch-000001.json", "batch-000002.json",
    ]  # fmt: skip


def test_chat_data_grown_at_its_end_reuses_every_full_batch(chatml_verifier, tmp_path):
    """A batch's key is its own rows' (and their lines'): rows added at the end leave the full
    batches before them reusable, only the last partial one is redone; a row edited in the
    middle redoes its batch alone."""
    from types import SimpleNamespace

    p = RegenerateParams(batch_size_samples=2, on_bad_row="skip")
    io = SimpleNamespace(verifier=chatml_verifier)
    rows = [{"messages": [U(f"Count from 1 to {n}."), A("...")]} for n in range(5)]
    keys = {}
    for name, lines in {
        "first": rows,
        "grown": rows + ["{not json", {"messages": [U("And to 9?"), A("...")]}],
        "edited": rows[:2] + [{"messages": [U("Count to 7."), A("...")]}] + rows[3:],
    }.items():
        index = regeneration.index_input(write_chat(tmp_path / f"{name}.jsonl", lines), p)
        keys[name] = regeneration.batch_keys(io, p, index, "float32")
    first, grown, edited = keys["first"], keys["grown"], keys["edited"]
    assert len(first) == 3 and len(grown) == 3 and len(set(first)) == 3
    assert grown[:2] == first[:2] and grown[2] != first[2]  # row 4 has a companion now
    assert edited[0] == first[0] and edited[1] != first[1] and edited[2] == first[2]
    assert (
        regeneration.batch_keys(io, p.model_copy(update={"temperature": 0.5}), index, "float32")[0]
        != edited[0]
    )  # a setting that changes answers changes every key

    work = tmp_path / "batches"
    for b, key in enumerate(first):
        empty_batch(key).write(regeneration.batch_path(work, b))
    assert regeneration.clean_work_dir(work, grown) == [0, 1]


def write_part(out: Path, job: int, num_jobs: int, batches: list[int], **changes) -> Path:
    part = RegeneratePart(**{
        "input_sha256": "i", "batch_keys": ["f"] * 3, "chat_data": "c.jsonl", "verifier": "v", "num_jobs": num_jobs,
        "job_index": job, "num_batches": 3, "batches": batches, "batches_reused": 0,
        "rows_in": 3, "bad_rows": {}, "seconds": 1.0, "params": {},
        "made_by": {"code": "c", "versions": {}}, **changes,
    })  # fmt: skip
    path = out / "parts" / f"part_{job}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    part.write(path)
    return path


def merge_error(monkeypatch, out: Path, num_jobs: int) -> str:
    monkeypatch.setattr(sys, "argv", ["regenerate_merge", *merge_args(out, num_jobs)])
    with pytest.raises(UserError) as exc:
        regenerate_merge.main()
    return str(exc.value)


def test_merge_writes_batches_in_order_and_refuses_what_does_not_fit(monkeypatch, tmp_path):
    for b in range(3):
        row = {"id": f"r{b}", "messages": [U("q"), A(f"answer {b}")]}
        stats = AnswerCounts(rows_out=1, turns=1, generated_tokens=2)
        (tmp_path / "batches").mkdir(exist_ok=True)
        AnswerBatch(fingerprint="f", rows=[row], stats=stats, bad={}).write(
            regeneration.batch_path(tmp_path / "batches", b)
        )
    write_part(tmp_path, 0, 2, [0, 2])
    write_part(tmp_path, 1, 2, [1])
    monkeypatch.setattr(sys, "argv", ["regenerate_merge", *merge_args(tmp_path, 2)])
    regenerate_merge.main()
    assert [r["id"] for r in read_jsonl(tmp_path / "chat_data.jsonl")] == ["r0", "r1", "r2"]
    stats = json.loads((tmp_path / STATS).read_text())
    assert stats["rows_out"] == 3 and stats["turns"] == 3 and stats["jobs"] == 2

    write_part(tmp_path, 1, 2, [1], batch_keys=["f", "other", "f"])
    assert "disagree on batch_keys" in merge_error(monkeypatch, tmp_path, 2)
    write_part(tmp_path, 1, 2, [2])
    assert "batches [2] are in two parts" in merge_error(monkeypatch, tmp_path, 2)
    write_part(tmp_path, 1, 2, [])
    assert "batches [1] are in no part" in merge_error(monkeypatch, tmp_path, 2)
    write_part(tmp_path, 1, 2, [1])
    regeneration.batch_path(tmp_path / "batches", 1).write_text('{"fingerprint": "f", "ro')
    msg = merge_error(monkeypatch, tmp_path, 2)
    assert "batch-000001.json: missing, cut short" in msg and "--forcerun regenerate" in msg


# --------------------------------------------------------------------------- real vLLM


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run(module: str, args: list[str]) -> subprocess.CompletedProcess:
    proc = run_stage(module, args, ROOT)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return proc


def run_script(verifier: Path, chat: Path, out: Path, **overrides) -> subprocess.CompletedProcess:
    """One regenerate job, then the merge; returns the job's process (its log in stderr)."""
    proc = run("workflow_scripts.stages.regenerate", args_for(verifier, chat, out, **overrides))
    run("workflow_scripts.stages.regenerate_merge", merge_args(out))
    return proc


@pytest.fixture(scope="module")
def demo_chat(demo_build, tmp_path_factory) -> Path:
    """The first 24 demo conversations (1 to 3 turns each)."""
    rows = read_jsonl(demo_build["chat_data"])[:24]
    return write_chat(tmp_path_factory.mktemp("regen") / "chat.jsonl", rows)


@pytest.fixture(scope="module")
def greedy(demo_build, demo_chat, tmp_path_factory):
    out = tmp_path_factory.mktemp("greedy")
    proc = run_script(demo_build["verifier"], demo_chat, out, batch_size_samples=8)
    return out, proc.stderr


@pytest.mark.engine
@pytest.mark.slow
def test_answers_are_the_verifiers_turn_by_turn(demo_build, demo_chat, greedy):
    from transformers import AutoModelForCausalLM

    out, log = greedy
    src, got = read_jsonl(demo_chat), read_jsonl(out / "chat_data.jsonl")
    assert [r["id"] for r in got] == [r["id"] for r in src]
    tok = AutoTokenizer.from_pretrained(demo_build["verifier"])
    model = AutoModelForCausalLM.from_pretrained(demo_build["verifier"]).eval()
    template = ChatTemplate(tok, verifier_dir=demo_build["verifier"])
    stops = template.stop_ids
    for s, g in zip(src, got):
        # system and user messages as they were, an assistant answer where there was one
        assert [m["role"] for m in g["messages"]] == [m["role"] for m in s["messages"]]
        assert [m for m in g["messages"] if m["role"] != "assistant"] == [
            m for m in s["messages"] if m["role"] != "assistant"
        ]
        text_only = [{k: m[k] for k in ("role", "content")} for m in g["messages"]]
        assert g["regenerate"]["turns"] == sum(m["role"] == "assistant" for m in s["messages"])
        # each answer is the verifier's greedy continuation of the conversation so far (its own
        # earlier answers included), as transformers computes it
        for i, m in enumerate(g["messages"]):
            if m["role"] != "assistant":
                continue
            ids = tok.apply_chat_template(text_only[:i], add_generation_prompt=True)
            ids = list(ids["input_ids"]) if hasattr(ids, "keys") else list(ids)
            import torch

            with torch.no_grad():
                hf = model.generate(
                    torch.tensor([ids]),
                    max_new_tokens=256,
                    do_sample=False,
                    eos_token_id=stops,
                    pad_token_id=tok.pad_token_id,
                )
            text = tok.decode(
                [t for t in hf[0, len(ids) :].tolist() if t not in stops], skip_special_tokens=True
            )
            assert m["content"] == text.strip(), (g["id"], i)
            # and the ids it was served and sampled, as they were: what prepare trains on
            assert m["regenerated_ids"]["prompt"] == ids, (g["id"], i)
            assert m["regenerated_ids"]["generated"] == hf[0, len(ids) :].tolist(), (g["id"], i)
        # prepare reads the output like any chat data, with assistant tokens to learn
        rows, _ = tokenize_rows(template, read_conversation(g), 512)
        assert len(rows) == 1 and sum(rows[0].loss_mask) > 0
    stats = json.loads((out / STATS).read_text())
    assert stats["rows_in"] == stats["rows_out"] == 24
    assert stats["turns"] == sum(r["regenerate"]["turns"] for r in got)
    assert stats["length_limited_turns"] == 0 and stats["bad_rows"] == {}
    assert stats["generated_tokens"] > 0 and stats["batches"] == 3
    assert len(list((out / "batches").glob("batch-*.json"))) == 3  # kept for a rerun merge
    assert "conversations/s" in log and "tokens/s" in log and "ETA" in log


@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.parametrize("policy", ["keep", "drop"])
def test_length_limits_are_counted_and_flagged(demo_build, demo_chat, tmp_path, policy):
    """Short turns and a short engine: answers cut at max_new_tokens_per_turn are flagged (or
    their conversations dropped), conversations that fill the engine end at their last answer,
    and one whose first prompt is too long is a bad row (skipped here)."""
    tok = AutoTokenizer.from_pretrained(demo_build["verifier"])
    rows = read_jsonl(demo_chat)
    long_row = {"id": "too-long", "messages": [U("word " * 400), A("x")]}
    chat = write_chat(tmp_path / "chat.jsonl", rows + [long_row])
    max_len, max_new = 72, 20
    run_script(
        demo_build["verifier"],
        chat,
        tmp_path,
        batch_size_samples=8,
        max_new_tokens_per_turn=max_new,
        max_model_len_tokens=max_len,
        on_bad_row="skip",
        on_length_limit=policy,
    )
    got = read_jsonl(tmp_path / "chat_data.jsonl")
    stats = json.loads((tmp_path / STATS).read_text())
    assert stats["bad_rows"] == {"too_long": 1} and "too-long" not in {r["id"] for r in got}
    flagged = [r for r in got if r["regenerate"]["length_limited_turns"]]
    assert stats["length_limited_conversations"] > 0 and stats["context_full_conversations"] > 0
    if policy == "keep":
        assert len(flagged) == stats["length_limited_conversations"]
        assert stats["rows_out"] == len(rows)
    else:
        assert (
            not flagged and stats["dropped_length_limited"] == stats["length_limited_conversations"]
        )
        assert stats["rows_out"] == len(rows) - stats["dropped_length_limited"] == len(got)
    for r in got:
        answers = [m for m in r["messages"] if m["role"] == "assistant"]
        assert r["messages"][-1]["role"] == "assistant" and len(answers) == r["regenerate"]["turns"]
        for m in answers:
            n = len(tok(m["content"], add_special_tokens=False)["input_ids"])
            assert n <= max_new + 2  # decoded text, tokenized again
        if r["regenerate"]["context_full"]:
            src = next(s for s in rows if s["id"] == r["id"])
            assert r["regenerate"]["turns"] < sum(m["role"] == "assistant" for m in src["messages"])


SAMPLED = dict(temperature=0.9, batch_size_samples=3)


@pytest.fixture(scope="module")
def resumed(demo_build, demo_chat, tmp_path_factory):
    """Sampled answers: one uninterrupted run; one run killed (SIGKILL, its process group) after
    its second finished batch, a finished batch cut short and a partial file planted, then
    restarted."""
    verifier = demo_build["verifier"]
    whole = tmp_path_factory.mktemp("whole")
    run_script(verifier, demo_chat, whole, **SAMPLED)

    out = tmp_path_factory.mktemp("killed")
    work = out / "batches"
    cmd = [
        sys.executable,
        "-m",
        "workflow_scripts.stages.regenerate",
        *args_for(verifier, demo_chat, out, **SAMPLED),
    ]
    kill_when(cmd, ROOT, lambda: len(list(work.glob("batch-*.json"))) >= 2, 300, "two batches")
    finished = sorted(work.glob("batch-*.json"))
    assert 2 <= len(finished) < 8, "the kill came too late to test a resume"
    assert not (out / "parts" / "part_0.json").exists()
    cut = finished[-1]
    cut.write_text(cut.read_text()[:50])
    (work / ".batch-000007.json.tmp-999999").write_text("partial")
    proc = run_script(verifier, demo_chat, out, **SAMPLED)
    return {"whole": whole, "out": out, "reused": len(finished) - 1, "log": proc.stderr}


@pytest.mark.engine
@pytest.mark.slow
def test_killed_job_resumes_only_unfinished_batches(resumed):
    reused = resumed["reused"]
    assert f"{reused} finished earlier, {8 - reused} to do" in resumed["log"]
    stats = json.loads((resumed["out"] / STATS).read_text())
    assert stats["batches"] == 8 and stats["batches_reused"] == reused
    # sampling is seeded per conversation and turn: the resumed run wrote what the whole run did
    whole = (resumed["whole"] / "chat_data.jsonl").read_text()
    assert (resumed["out"] / "chat_data.jsonl").read_text() == whole
    assert not list((resumed["out"] / "batches").glob(".batch-*"))  # no partial file is left


@pytest.mark.engine
@pytest.mark.slow
def test_sampled_answers_differ_from_greedy_ones(greedy, resumed):
    """temperature reaches the engine: sampled answers are not the greedy ones."""
    greedy_rows = read_jsonl(greedy[0] / "chat_data.jsonl")
    sampled_rows = read_jsonl(resumed["whole"] / "chat_data.jsonl")
    differ = sum(g["messages"] != s["messages"] for g, s in zip(greedy_rows, sampled_rows))
    assert differ > 0


@pytest.mark.engine
@pytest.mark.slow
def test_two_jobs_write_what_one_job_writes(demo_build, demo_chat, greedy, tmp_path):
    """Two data-parallel jobs, run side by side, each answer their own batches; merged, they give
    the one job's dataset, byte for byte."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "workflow_scripts.stages.regenerate",
             *args_for(demo_build["verifier"], demo_chat, tmp_path, job, batch_size_samples=8, num_jobs=2)],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        for job in (0, 1)
    ]
    for proc in procs:
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-4000:]
    parts = [json.loads((tmp_path / "parts" / f"part_{j}.json").read_text()) for j in (0, 1)]
    assert [p["batches"] for p in parts] == [[0, 2], [1]]
    run("workflow_scripts.stages.regenerate_merge", merge_args(tmp_path, 2))
    one = greedy[0] / "chat_data.jsonl"
    assert (tmp_path / "chat_data.jsonl").read_text() == one.read_text()
    assert json.loads((tmp_path / STATS).read_text())["jobs"] == 2


@pytest.mark.engine
@pytest.mark.pinned
def test_tensor_parallel_regeneration_answers_as_one_worker(
    demo_build, demo_chat, greedy, tmp_path
):
    """regenerate.tensor_parallel_size 2 on the CPU (two workers, each bound to a core by the
    stage): the same greedy answers as one worker."""
    proc = run_script(
        demo_build["verifier"], demo_chat, tmp_path, batch_size_samples=8, tensor_parallel_size=2
    )
    assert "engine ready" in proc.stderr
    one = read_jsonl(greedy[0] / "chat_data.jsonl")
    two = read_jsonl(tmp_path / "chat_data.jsonl")
    assert [r["id"] for r in two] == [r["id"] for r in one]
    assert [r["messages"] for r in two] == [r["messages"] for r in one]


def test_every_kind_of_bad_row_is_named_and_counted_before_the_model_loads(
    monkeypatch, chatml_verifier, tmp_path
):
    """The rows prepare refuses, in one file: the pass before the model loads counts each under
    its reason (skip) or stops at the first with file and line (fail); never a traceback."""
    verifier = refusing_tokenizer(tmp_path / "verifier", chatml_verifier)
    (tmp_path / "verifier" / "config.json").write_bytes(
        (chatml_verifier / "config.json").read_bytes()
    )
    tokenizer = ChatTemplate(AutoTokenizer.from_pretrained(verifier), verifier_dir=verifier)
    good = json.dumps({"messages": [U("q"), A("a")]}).encode()
    # a row with no user turn is bad here too; a lone question is not (it gets an answer)
    rows = EVERY_BAD_ROW + [(json.dumps({"messages": [S, A("hi")]}).encode(), "no_user_turn")]
    expected = Counter(reason for _, reason in rows if reason != "no_assistant_tokens")
    data = tmp_path / "chat.jsonl"
    data.write_bytes(b"\n".join(line for raw, _ in rows for line in (good, raw)) + b"\n")
    index = regeneration.index_input(data, RegenerateParams(on_bad_row="skip"), tokenizer)
    assert index.bad == expected
    assert len(index.offsets) == len(rows) + 1 and index.rows_in == 2 * len(rows)
    for i, (raw, reason) in enumerate(rows):
        if reason == "no_assistant_tokens":
            continue
        one = tmp_path / f"one{i}.jsonl"
        one.write_bytes(good + b"\n" + raw + b"\n")
        with pytest.raises(UserError, match=rf"{re.escape(str(one))}:2: .*on_bad_row: skip"):
            regeneration.index_input(one, RegenerateParams(on_bad_row="fail"), tokenizer)
