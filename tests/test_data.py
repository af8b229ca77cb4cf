"""Chat data and evaluation prompts where users keep them (lib/data, the data stage): every file
kind gives the same rows, layouts chosen from the columns, mixtures with the counts asked for,
hub datasets pinned to a commit or refused without the hub, public evaluation sets. No engine."""

from __future__ import annotations

import gzip
import io
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.tokenizers_for_tests import build_chatml_tokenizer
from tests.workflow_runner import copy_workflow, dry_run_in_process
from workflow_scripts.lib.chat.tokenization import tokenize_chat_file
from workflow_scripts.lib.chat.template import ChatTemplate
from workflow_scripts.lib.common import Progress, UserError
from workflow_scripts.lib.data.files import source_files
from workflow_scripts.lib.data.hub import pin
from workflow_scripts.lib.data.layouts import chat_layout, chat_row
from workflow_scripts.lib.data.mixture import mix, plan_counts
from workflow_scripts.lib.data.resolve import humaneval_file
from workflow_scripts.lib.evaluation.acceptance import load_prompt_sets
from workflow_scripts.lib.workflow import cli
from workflow_scripts.lib.workflow.definitions import DataParams
from workflow_scripts.lib.workflow.sources import ChatSource, EvalPrompts, PromptSource
from workflow_scripts.lib.workflow.layout import STATS

ROWS = [
    {
        "id": f"c{i}",
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": f"Count from {i} to {i + 4}."},
            {"role": "assistant", "content": ", ".join(str(n) for n in range(i, i + 5)) + "."},
        ],
    }
    for i in range(7)
]


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    from transformers import AutoTokenizer

    directory = build_chatml_tokenizer(tmp_path_factory.mktemp("chatml"))
    return ChatTemplate(AutoTokenizer.from_pretrained(directory))


def write_kind(directory: Path, kind: str, rows: list[dict]) -> Path:
    """``rows`` saved as a file (or save_to_disk directory) of ``kind``."""
    text = "".join(json.dumps(r) + "\n" for r in rows)
    path = directory / f"chats.{kind}"
    if kind == "jsonl":
        path.write_text(text)
    elif kind == "jsonl.gz":
        path.write_bytes(gzip.compress(text.encode()))
    elif kind == "jsonl.zst":
        import zstandard

        path.write_bytes(zstandard.ZstdCompressor().compress(text.encode()))
    elif kind == "json":
        path.write_text(json.dumps(rows, indent=1))
    elif kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=3)
    else:
        from datasets import Dataset

        path = directory / "saved"
        Dataset.from_list(rows).save_to_disk(str(path))
    return path


def mixed(sources: list[ChatSource], seed: int = 0, num_rows: int | None = None):
    out = io.StringIO()
    files = [source_files(s.path, "chat_data") if s.path else [] for s in sources]
    stats = mix(sources, files, seed, num_rows, out, Progress("data", None, 1e9))
    return [json.loads(line) for line in out.getvalue().splitlines()], stats


def tokenized(path: Path, template: ChatTemplate) -> str:
    out = io.StringIO()
    tokenize_chat_file(path, template, 4096, "fail", out, Progress("prepare", None, 1e9))
    return out.getvalue()


@pytest.mark.parametrize("kind", ["jsonl.gz", "jsonl.zst", "json", "parquet", "saved"])
def test_every_kind_of_file_gives_the_same_tokenized_data(kind, tmp_path, template):
    """The same conversations as JSON Lines, compressed, a JSON array, Parquet or a saved
    dataset: byte-identical tokenized_data.jsonl."""
    outputs = {}
    for name in ("jsonl", kind):
        (tmp_path / name).mkdir()
        rows, _ = mixed([ChatSource(path=str(write_kind(tmp_path / name, name, ROWS)))])
        assert [r["source_row"].rsplit(":", 1)[1] for r in rows] == [str(i) for i in range(1, 8)]
        data = tmp_path / name / "data.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        outputs[name] = tokenized(data, template)
    assert outputs[kind] == outputs["jsonl"]
    assert len(outputs[kind].splitlines()) == len(ROWS)


def test_a_directory_or_glob_reads_each_file_in_order(tmp_path):
    (tmp_path / "d").mkdir()
    write_kind(tmp_path / "d", "jsonl", ROWS[:3])
    write_kind(tmp_path / "d", "parquet", ROWS[3:])
    for path in (tmp_path / "d", tmp_path / "d" / "chats.*"):
        rows, stats = mixed([ChatSource(path=str(path))])
        assert [r["id"] for r in rows] == [f"c{i}" for i in range(7)]  # chats.jsonl, .parquet
        assert stats["sources"][0]["rows_taken"] == 7
    with pytest.raises(UserError, match="matches no file"):
        source_files(str(tmp_path / "d" / "*.csv"), "chat_data[0].path")


def test_layouts_are_chosen_from_the_columns(tmp_path):
    sharegpt = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}
    lmsys = {
        "conversation": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    }
    magpie = {"instruction": "hi", "response": "yo", "system": "Be brief."}
    assert chat_layout("auto", list(sharegpt), "s") == ("conversations", None)
    assert chat_row(lmsys, *chat_layout("auto", list(lmsys), "l"))["messages"][1]["content"] == "yo"
    layout, pair = chat_layout("auto", list(magpie), "m")
    assert (layout, pair) == ("prompt_response", ("instruction", "response"))
    assert [m["role"] for m in chat_row(magpie, layout, pair)["messages"]] == [
        "system", "user", "assistant",
    ]  # fmt: skip
    with pytest.raises(UserError, match=r"no known layout fits its columns \(text, label\)"):
        chat_layout("auto", ["text", "label"], "odd")
    path = write_kind(tmp_path, "jsonl", [{"q": "hi", "a": "yo"}])
    source = ChatSource(
        path=str(path), layout="prompt_response", prompt_column="q", response_column="a"
    )
    rows, stats = mixed([source])
    assert rows[0]["messages"][0] == {"role": "user", "content": "hi"}
    assert stats["sources"][0]["layout"] == "prompt_response (q, a)"


def test_rows_that_cannot_be_read_are_passed_on_with_where_they_are(tmp_path, template):
    path = tmp_path / "chats.jsonl"
    path.write_bytes(json.dumps(ROWS[0]).encode() + b"\n{not json\n" + json.dumps(ROWS[1]).encode())
    rows, stats = mixed([ChatSource(path=str(path))])
    assert rows[1] == {
        "source": "chats",
        "source_row": f"{path}:2",
        "bad_row": {"reason": "malformed", "detail": "not valid JSON (Expecting property name "
                    "enclosed in double quotes)"},
    }  # fmt: skip
    assert stats["sources"][0]["rows_unreadable"] == {"malformed": 1}
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(UserError, match=rf"{path}:2: not valid JSON"):
        tokenized(data, template)
    out = io.StringIO()
    stats = tokenize_chat_file(data, template, 4096, "skip", out, Progress("p", None, 1e9))
    assert stats["dropped"] == {"malformed": 1}
    assert stats["conversations_by_source"] == {"chats": {"in": 3, "out": 2}}


def source(n: int, tmp_path: Path, name: str, **share) -> ChatSource:
    rows = [{**ROWS[i % len(ROWS)], "id": f"{name}{i}"} for i in range(n)]
    return ChatSource(path=str(write_kind(tmp_path / name, "jsonl", rows)), name=name, **share)


def test_a_mixture_gives_the_counts_asked_for(tmp_path):
    for name in ("a", "b", "c"):
        (tmp_path / name).mkdir()
    a, b = source(100, tmp_path, "a", weight=3), source(50, tmp_path, "b", weight=1)
    c = source(20, tmp_path, "c", rows=5)
    rows, stats = mixed([a, b, c], seed=1, num_rows=45)
    taken = {s["name"]: s["rows_taken"] for s in stats["sources"]}
    assert taken == {"a": 30, "b": 10, "c": 5}
    assert [r["id"][0] for r in rows] == ["a"] * 30 + ["b"] * 10 + ["c"] * 5
    assert mixed([a, b, c], seed=1, num_rows=45)[0] == rows  # the same seed, the same rows
    assert mixed([a, b, c], seed=2, num_rows=45)[0] != rows
    # without num_rows: as many as the weights allow without repeating a row (b is scarcest)
    assert plan_counts([a, b], [100, 50], None) == [100, 33]  # 133 rows: 99.75 and 33.25
    assert plan_counts([a, b], [90, 50], None) == [90, 30]
    with pytest.raises(UserError, match="source 'c' has 20 rows, fewer than the 30"):
        plan_counts([ChatSource(path="x", name="c", rows=30)], [20], None)
    with pytest.raises(UserError, match="source 'b' has 50 rows, fewer than the 75"):
        plan_counts([a, b], [1000, 50], 300)


def test_a_hub_dataset_is_pinned_to_the_commit_first_recorded(tmp_path):
    lock = tmp_path / "sources.lock.json"
    hub = ChatSource(hub="org/chats", split="train")
    commits = iter(["a" * 40, "b" * 40])
    pinned, warnings = pin([hub], lock, "chat_data", lambda name, rev: next(commits))
    assert pinned[0].revision == "a" * 40 and not warnings
    assert json.loads(lock.read_text()) == {"org/chats||main": "a" * 40}
    pinned, warnings = pin([hub], lock, "chat_data", lambda name, rev: next(commits))
    assert pinned[0].revision == "a" * 40  # the branch moved: the recorded commit is kept
    assert "has moved to commit bbbb" in warnings[0] and str(lock) in warnings[0]

    def offline(name, rev):
        raise ConnectionError("no hub")

    assert pin([hub], lock, "chat_data", offline)[0][0].revision == "a" * 40


def test_a_hub_dataset_is_refused_at_dry_run_without_the_hub(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    work = copy_workflow(tmp_path / "wf")
    config = {
        "chat_data": [{"hub": "HuggingFaceH4/ultrachat_200k", "split": "train_sft"}],
        "eval_prompts": {"set": "humaneval"},
    }
    error, out = dry_run_in_process(work, "draft_ckpt", config)
    assert error is not None
    assert "config key 'chat_data[0]': hub dataset HuggingFaceH4/ultrachat_200k" in error
    assert "'path: DIR' instead of 'hub'" in error and "save_to_disk" in error
    assert not (work / "results" / "sources.lock.json").exists()


def test_local_sources_plan_the_data_stage_at_dry_run(tmp_path):
    work = copy_workflow(tmp_path / "wf")
    (tmp_path / "d").mkdir()
    path = write_kind(tmp_path / "d", "parquet", ROWS)
    config = {"chat_data": [{"path": str(path), "weight": 1}], "eval_prompts": {"set": "humaneval"}}
    error, out = dry_run_in_process(work, "vocab_map", config)
    assert error is None, out[-3000:]
    missing = {
        "chat_data": [{"path": str(tmp_path / "nothing.parquet")}],
        "eval_prompts": "p.jsonl",
    }
    error, _ = dry_run_in_process(work, "vocab_map", missing)
    assert "config key 'chat_data[0].path'" in error and "does not exist" in error


# --------------------------------------------------------------------------- files cut short


def many_rows(n: int) -> list[dict]:
    return [{**ROWS[i % len(ROWS)], "id": f"c{i}"} for i in range(n)]


def cut(path: Path, keep: float | int) -> Path:
    data = path.read_bytes()
    path.write_bytes(data[: keep if isinstance(keep, int) else int(len(data) * keep)])
    return path


def damaged_files(directory: Path) -> dict[str, tuple[Path, str]]:
    """Files that cannot be read whole, each with what the error must say."""
    out = {}
    for kind, keep in (("jsonl.zst", 0.7), ("jsonl.gz", 0.5), ("json", 0.6), ("parquet", 0.8)):
        (directory / kind).mkdir()
        path = cut(write_kind(directory / kind, kind, many_rows(6000)), keep)
        out[f"{kind} cut"] = path, "cut short" if kind != "parquet" else "corrupt"
    (directory / "fragment").mkdir()
    out["zst fragment"] = (
        cut(write_kind(directory / "fragment", "jsonl.zst", ROWS), 200),
        "cut short",
    )
    (directory / "flipped").mkdir()
    flipped = write_kind(directory / "flipped", "jsonl.zst", many_rows(600))
    data = bytearray(flipped.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 64] = bytes(64)
    flipped.write_bytes(bytes(data))
    out["zst corrupt"] = flipped, "corrupt"
    plain = directory / "plain.jsonl.gz"
    plain.write_text(json.dumps(ROWS[0]) + "\n")
    out["not gzip"] = plain, "not a gzip"
    return out


def test_files_cut_short_or_corrupt_are_refused_naming_them(tmp_path):
    for case, (path, says) in damaged_files(tmp_path).items():
        with pytest.raises(UserError, match=f"{re.escape(str(path))}: .*{says}"):
            mixed([ChatSource(path=str(path))])
        with pytest.raises(UserError, match=re.escape(str(path))):  # counted for a sample
            mixed([ChatSource(path=str(path), rows=5)])
        with pytest.raises(UserError, match=re.escape(str(path))):
            load_prompt_sets([PromptSource(path=str(path))], None, None)


def test_a_zst_file_of_several_frames_is_read_whole(tmp_path):
    import zstandard

    rows = many_rows(50)
    frames = [zstandard.ZstdCompressor().compress(json.dumps(r).encode() + b"\n") for r in rows]
    path = tmp_path / "frames.jsonl.zst"
    path.write_bytes(b"".join(frames))
    assert [r["id"] for r in mixed([ChatSource(path=str(path))])[0]] == [r["id"] for r in rows]


def test_the_data_stage_stops_on_a_file_cut_short_without_a_traceback(tmp_path):
    path = cut(write_kind(tmp_path, "jsonl.zst", many_rows(6000)), 0.7)
    files = {
        "mixture": tmp_path / "out" / "chat_data.jsonl",
        "stats": tmp_path / "out" / STATS,
    }
    params = DataParams(chat_data=[{"path": str(path)}])
    proc = subprocess.run(
        [sys.executable, "-m", "workflow_scripts.stages.data", *shlex.split(cli.render("data", params, files))],
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert f"{path}: the zstd (.zst) file is cut short" in proc.stderr
    assert "Traceback" not in proc.stderr and not files["mixture"].exists()


# --------------------------------------------------------------------------- evaluation sets


def test_humaneval_ships_with_its_package(template):
    assert humaneval_file().is_file()
    sets = EvalPrompts([{"set": "humaneval"}]).root
    sets = [s.model_copy(update={"path": str(humaneval_file())}) for s in sets]
    prompts = load_prompt_sets(sets, template, None)
    assert len(prompts) == 164 and prompts[0]["id"] == "HumanEval/0"
    assert prompts[0]["messages"][0]["content"].startswith("from typing import List")
    assert len(load_prompt_sets(sets, template, 5)) == 5


def test_mt_bench_second_turns_and_gsm8k_questions(tmp_path, template):
    fastchat = tmp_path / "question.jsonl"
    fastchat.write_text(
        json.dumps({"question_id": 81, "category": "writing", "turns": ["Write.", "Shorter."]})
        + "\n"
    )
    (tmp_path / "h4").mkdir()
    h4 = write_kind(tmp_path / "h4", "parquet", [{"prompt": ["Hi.", "More."], "prompt_id": 7}])
    (tmp_path / "g").mkdir()
    gsm8k = write_kind(tmp_path / "g", "parquet", [{"question": "1 + 1?", "answer": "2"}])
    sets = [
        PromptSource(set="mt_bench", path=str(fastchat)),
        PromptSource(set="mt_bench", path=str(h4), name="mt_bench_h4"),
        PromptSource(set="gsm8k", path=str(gsm8k)),
    ]
    prompts = load_prompt_sets(sets, template, None)
    assert [(p["set"], p["id"], p["later_turns"]) for p in prompts] == [
        ("mt_bench", 81, ["Shorter."]),
        ("mt_bench_h4", 7, ["More."]),
        ("gsm8k", f"{gsm8k}:1", []),
    ]
    assert prompts[2]["messages"] == [{"role": "user", "content": "1 + 1?"}]
    assert prompts[0]["prompt_token_ids"] == template.prompt_ids(prompts[0]["messages"])
