"""prepare: chat template, assistant-only loss mask, bad input, streaming, stats."""

from __future__ import annotations

import contextlib
import io
import json
import re
import shlex
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
import yaml
from transformers import AutoTokenizer

from tests.bad_rows import EVERY_BAD_ROW, refusing_tokenizer
from tests.chat_families import FAMILIES, build_tokenizer, conversation_set
from tests.tokenizers_for_tests import build_chatml_tokenizer
from tests.workflow_runner import copy_workflow
from workflow_scripts.lib.chat import tokenization
from workflow_scripts.lib.chat.tokenization import tokenize_chat_file, tokenize_conversation
from workflow_scripts.lib.chat.rows import BadRow, normalize
from workflow_scripts.lib.chat.template import ChatTemplate, load_template
from workflow_scripts.lib.common import Progress, UserError
from workflow_scripts.lib.workflow import cli
from workflow_scripts.lib.workflow.definitions import PrepareParams
from workflow_scripts.lib.workflow.params_base import ChatTemplateSettings
from workflow_scripts.lib.workflow.layout import STATS

ROOT = Path(__file__).resolve().parents[1]

CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Count from 3 to 7."},
    {"role": "assistant", "content": "3, 4, 5, 6, 7."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
]


@pytest.fixture(scope="module")
def chatml_dir(tmp_path_factory) -> Path:
    return build_chatml_tokenizer(tmp_path_factory.mktemp("chatml"))


def masked_runs(ids, mask):
    runs, current = [], []
    for token, m in zip(ids, mask):
        if m:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return runs


def template_ids(tokenizer, messages, **kwargs):
    out = tokenizer.apply_chat_template(messages, tokenize=True, **kwargs)
    return list(out["input_ids"]) if hasattr(out, "keys") else list(out)


def check_mask_matches_template_spans(tokenizer, messages, end_of_turn):
    """Each masked run decodes to exactly one assistant reply plus the end-of-turn token, in
    order; nothing else (headers, roles, user text, the newline after the turn) is masked."""
    sample = tokenize_conversation(tokenizer, messages, max_len=10_000)
    # the template's tokens, up to the stop token that ends the last turn (not what follows it)
    rendered = template_ids(tokenizer, messages)
    assert sample.input_ids == rendered[: len(sample.input_ids)]
    assert tokenizer.decode(rendered[len(sample.input_ids) :]).strip() == ""
    runs = masked_runs(sample.input_ids, sample.loss_mask)
    replies = [m["content"].strip() for m in messages if m["role"] == "assistant"]
    assert [tokenizer.decode(r) for r in runs] == [r + end_of_turn for r in replies]
    # and the span boundaries are where the template puts the reply: right after the
    # generation prompt of that turn
    for i, msg in enumerate(messages):
        if msg["role"] != "assistant":
            continue
        prefix = template_ids(tokenizer, messages[:i], add_generation_prompt=True)
        assert sample.loss_mask[len(prefix) - 1] == 0 and sample.loss_mask[len(prefix)] == 1


def test_chatml_mask(chatml_dir):
    tokenizer = AutoTokenizer.from_pretrained(chatml_dir)
    check_mask_matches_template_spans(tokenizer, CONVERSATION, "<|im_end|>")


def test_demo_template_mask(demo_build):
    tokenizer = AutoTokenizer.from_pretrained(demo_build["verifier"])
    check_mask_matches_template_spans(tokenizer, CONVERSATION, "<|eot_id|>")
    with open(demo_build["chat_data"]) as fh:
        for line, _ in zip(fh, range(50)):
            messages = normalize(json.loads(line)).messages
            check_mask_matches_template_spans(tokenizer, messages, "<|eot_id|>")


def test_sharegpt_and_messages_are_the_same():
    sharegpt = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}
    messages = {
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    }
    assert normalize(sharegpt) == normalize(messages)


@pytest.mark.parametrize(
    "row, reason",
    [
        ({"messages": []}, "empty_conversation"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "unknown_role"),
        ({"text": "x"}, "malformed"),
        ({"messages": [{"role": "user"}]}, "malformed"),
        ([1, 2], "malformed"),
    ],
)
def test_bad_rows(row, reason):
    with pytest.raises(BadRow) as err:
        normalize(row)
    assert err.value.reason == reason


def write_jsonl(path: Path, rows) -> Path:
    with open(path, "w") as fh:
        for row in rows:
            fh.write(row if isinstance(row, str) else json.dumps(row))
            fh.write("\n")
    return path


def run_prepare(tmp_path, verifier, chat_data, **params):
    files = {
        "chat_data": chat_data,
        "verifier": verifier,
        "tokenized": tmp_path / "out" / "tokenized_data.jsonl",
        "stats": tmp_path / "out" / STATS,
    }
    args = shlex.split(cli.render("prepare", PrepareParams(**params), files))
    proc = subprocess.run(
        [sys.executable, "-m", "workflow_scripts.stages.prepare", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    return proc, files


GOOD = {"messages": CONVERSATION}
BAD_ROWS = [
    GOOD,
    "{not json",
    {"messages": [{"role": "robot", "content": "beep"}]},
    {"messages": []},
    {"messages": [{"role": "user", "content": "only a question"}]},
    {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "Paris."}]},
]


def test_bad_input_fails_with_file_and_line(tmp_path, chatml_dir):
    data = write_jsonl(tmp_path / "chat.jsonl", BAD_ROWS)
    proc, files = run_prepare(tmp_path, chatml_dir, data, on_bad_row="fail")
    assert proc.returncode == 2
    assert f"{data}:2: not valid JSON" in proc.stderr and "on_bad_row: skip" in proc.stderr
    assert not files["tokenized"].exists() and not files["stats"].exists()


def test_bad_input_skipped_and_counted(tmp_path, chatml_dir):
    data = write_jsonl(tmp_path / "chat.jsonl", BAD_ROWS)
    proc, files = run_prepare(tmp_path, chatml_dir, data, on_bad_row="skip")
    assert proc.returncode == 0, proc.stderr
    stats = json.loads(files["stats"].read_text())
    assert stats["rows_in"] == 6 and stats["rows_out"] == 2
    assert stats["dropped"] == {
        "empty_conversation": 1,
        "malformed": 1,
        "no_assistant_tokens": 1,
        "unknown_role": 1,
    }
    rows = [json.loads(line) for line in files["tokenized"].read_text().splitlines()]
    assert [r["id"] for r in rows] == ["line1", "line6"]
    assert stats["tokens"] == sum(len(r["input_ids"]) for r in rows)
    assert stats["loss_masked_tokens"] == sum(sum(r["loss_mask"]) for r in rows)
    assert "prepare: " in proc.stderr and "rows/s" in proc.stderr  # progress line


def test_truncation_and_rows_left_without_assistant_tokens(tmp_path, chatml_dir):
    tokenizer = AutoTokenizer.from_pretrained(chatml_dir)
    full = tokenize_conversation(tokenizer, CONVERSATION, 10_000)
    first_reply = full.loss_mask.index(1)
    data = write_jsonl(tmp_path / "chat.jsonl", [GOOD])
    proc, files = run_prepare(tmp_path, chatml_dir, data, max_seq_len_tokens=first_reply + 2)
    row = json.loads(files["tokenized"].read_text())
    assert len(row["input_ids"]) == first_reply + 2 and sum(row["loss_mask"]) == 2
    assert json.loads(files["stats"].read_text())["truncated_rows"] == 1
    # cut before any assistant token: the row is dropped and counted, even with on_bad_row=fail
    proc, files = run_prepare(
        tmp_path,
        chatml_dir,
        write_jsonl(tmp_path / "c2.jsonl", [GOOD, GOOD]),
        max_seq_len_tokens=first_reply,
    )
    assert proc.returncode == 2 and "no usable conversation" in proc.stderr


def test_tokenizer_without_chat_template_is_refused(tmp_path, chatml_dir):
    plain = tmp_path / "plain"
    tokenizer = AutoTokenizer.from_pretrained(chatml_dir)
    tokenizer.chat_template = None
    tokenizer.save_pretrained(plain)
    (plain / "chat_template.jinja").unlink(missing_ok=True)
    proc, _ = run_prepare(tmp_path, plain, write_jsonl(tmp_path / "c.jsonl", [GOOD]))
    assert proc.returncode == 2 and "has no chat template" in proc.stderr, proc.stderr


def test_memory_stays_flat_as_input_grows(tmp_path, chatml_dir):
    """Peak RSS with 40x the rows stays within a few MB of the small run: the input streams."""

    def peak_rss_kb(n_rows):
        data = write_jsonl(tmp_path / f"chat{n_rows}.jsonl", [GOOD] * n_rows)
        files = {
            "chat_data": data,
            "verifier": chatml_dir,
            "tokenized": tmp_path / f"t{n_rows}.jsonl",
            "stats": tmp_path / f"s{n_rows}.json",
        }
        args = shlex.split(cli.render("prepare", PrepareParams(), files))
        code = (
            "import resource, runpy, sys; sys.argv = ['prepare'] + sys.argv[1:];"
            "from workflow_scripts.lib.common import run_main; from workflow_scripts.stages.prepare import main;"
            "run_main(main); print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)"
        )
        proc = subprocess.run(
            [sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True
        )
        assert proc.returncode == 0, proc.stderr
        return int(proc.stdout.split()[-1])

    small, large = peak_rss_kb(200), peak_rss_kb(8_000)
    assert large - small < 30_000, (small, large)


def test_every_kind_of_bad_row_is_named_and_counted(tmp_path, chatml_dir):
    """One file with every bad row kind between good ones (a byte-order mark on the first): under
    skip each is counted by its reason, under fail the first is named with file and line; never
    a traceback."""
    verifier = refusing_tokenizer(tmp_path / "verifier", chatml_dir)
    good = json.dumps(GOOD).encode()
    lines = [b"\xef\xbb\xbf" + good]
    for raw, _ in EVERY_BAD_ROW:
        lines += [raw, good]
    data = tmp_path / "chat.jsonl"
    data.write_bytes(b"\n".join(lines) + b"\n")

    proc, files = run_prepare(tmp_path, verifier, data, on_bad_row="skip")
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    stats = json.loads(files["stats"].read_text())
    expected: dict[str, int] = {}
    for _, reason in EVERY_BAD_ROW:
        expected[reason] = expected.get(reason, 0) + 1
    assert stats["dropped"] == expected
    assert stats["rows_in"] == 2 * len(EVERY_BAD_ROW) + 1
    assert stats["rows_out"] == len(EVERY_BAD_ROW) + 1
    assert f"{data}:2: skipped: not valid UTF-8 (byte 0xe9" in proc.stderr
    assert "'messages' must be a list of messages, not a string" in proc.stderr

    # under fail: each kind stops the stage with file, line and the key (in-process: the
    # script's own loop, with its tokenizer loaded once)
    tokenizer = AutoTokenizer.from_pretrained(verifier)
    for i, (raw, reason) in enumerate(EVERY_BAD_ROW):
        if reason == "no_assistant_tokens":  # always skipped and counted
            continue
        one = tmp_path / f"one{i}.jsonl"
        one.write_bytes(good + b"\n" + raw + b"\n")
        with pytest.raises(UserError, match=rf"{re.escape(str(one))}:2: .*on_bad_row: skip"):
            template = ChatTemplate(tokenizer, verifier_dir=verifier)
            tokenize_chat_file(one, template, 512, "fail", io.StringIO(), Progress("t", None))


def test_rows_as_users_bring_them_reach_the_template_under_its_names():
    """Reasoning under any of its names or inline, tool calls with arguments as an object or a
    JSON string, tool results of role tool/ipython/function, a tools list: one form."""
    row = {
        "id": "r1",
        "tools": [{"type": "function", "function": {"name": "f"}}],
        "messages": [
            {"role": "user", "content": "q", "extra_field": 1},
            {"role": "assistant", "thinking": "r0", "content": "a0"},
            {"role": "user", "content": "q2"},
            {"role": "assistant", "content": "<think>\nr1\n</think>\n\na1"},
            {"role": "user", "content": "q3"},
            {
                "role": "assistant",
                "content": None,
                "reasoning": "r2",
                "tool_calls": [
                    {
                        "id": "c",
                        "type": "function",
                        "function": {"name": "f", "arguments": '{"x": 1}'},
                    }
                ],
            },
            {"role": "ipython", "content": "out", "tool_call_id": "c", "name": "f"},
        ],
    }
    conv = normalize(row)
    assert conv.tools == row["tools"] and conv.row_id == "r1"
    assert [m["role"] for m in conv.messages] == ["user", "assistant"] * 3 + ["tool"]
    assert conv.messages[0] == {"role": "user", "content": "q"}  # unknown fields ignored
    assert [conv.messages[i].get("reasoning") for i in (1, 3, 5)] == ["r0", "r1", "r2"]
    assert conv.messages[3]["content"] == "a1" and conv.messages[5]["content"] == ""
    call = conv.messages[5]["tool_calls"][0]
    assert call == {"id": "c", "name": "f", "arguments": {"x": 1}, "arguments_text": '{"x": 1}'}
    assert conv.messages[6] == {"role": "tool", "content": "out", "tool_call_id": "c", "name": "f"}


def test_a_data_set_whose_masks_come_out_empty_stops_naming_the_template(tmp_path, chatml_dir):
    """Reasoning that the template renders nowhere: each row is a bad row of its own reason
    (counted under skip), and when none is left the stage stops naming the template."""
    row = {
        "messages": [
            {"role": "user", "content": "q"},
            {"role": "assistant", "reasoning_content": "because", "content": "a"},
        ]
    }
    data = write_jsonl(tmp_path / "chat.jsonl", [row, row])
    proc, _ = run_prepare(tmp_path, chatml_dir, data, on_bad_row="skip")
    assert proc.returncode == 2, proc.stderr
    assert "reasoning_not_rendered" in proc.stderr or "renders none" in proc.stderr
    assert f"no supervised token came out of the chat template of {chatml_dir}" in proc.stderr
    proc, _ = run_prepare(tmp_path, chatml_dir, data, on_bad_row="fail")
    assert proc.returncode == 2 and f"{data}:1: message 1 has reasoning" in proc.stderr


def test_an_assistant_turn_with_nothing_in_it_is_a_bad_row(chatml_dir):
    tokenizer = AutoTokenizer.from_pretrained(chatml_dir)
    with pytest.raises(BadRow) as err:
        tokenize_conversation(
            tokenizer, [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""}], 99
        )
    assert err.value.reason == "empty_turn"


# --------------------------------------------------------------------------- processes


@pytest.fixture(scope="module")
def qwen3_chat(tmp_path_factory):
    """A Qwen3-family verifier (its template drops earlier reasoning: conversations of two rows)
    and its 36 conversations with a bad row after every third, as one file."""
    tmp = tmp_path_factory.mktemp("qwen3")
    verifier = build_tokenizer(FAMILIES["qwen3"], tmp / "verifier")
    lines = []
    for i, row in enumerate(conversation_set("qwen3")):
        lines.append(json.dumps(row).encode())
        if i % 3 == 2:
            lines.append(EVERY_BAD_ROW[i // 3][0])
    data = tmp / "chat.jsonl"
    data.write_bytes(b"\n".join(lines) + b"\n")
    return verifier, data


def tokenize_with(verifier, data, processes, on_bad_row, max_len=64):
    settings = ChatTemplateSettings()
    out = io.StringIO()
    stats = tokenize_chat_file(
        data,
        load_template(verifier, settings),
        max_len,
        on_bad_row,
        out,
        Progress("t", None),
        processes=processes,
        load=partial(load_template, verifier, settings),
    )
    return out.getvalue(), stats


def test_the_output_is_the_same_bytes_for_any_number_of_processes(qwen3_chat, monkeypatch):
    """Bad rows, conversations of two rows, rows truncated, conversations left without a
    supervised token, under skip, in chunks of 4 lines: 2 and 3 processes write what one
    writes, byte for byte, and count the same."""
    verifier, data = qwen3_chat
    monkeypatch.setattr(tokenization, "CHUNK_LINES", 4)
    text, stats = tokenize_with(verifier, data, 1, "skip")
    assert stats["truncated_rows"] > 0 and stats["rows_per_conversation"].keys() == {"1", "2"}
    assert {"malformed", "not_utf8", "no_assistant_tokens"} <= stats["dropped"].keys()
    for processes in (2, 3):
        assert tokenize_with(verifier, data, processes, "skip") == (text, stats)


def test_under_fail_the_first_bad_row_in_input_order_is_named(qwen3_chat, monkeypatch, tmp_path):
    """The first bad row ends a chunk of three conversations; the chunk after it, of bad rows
    only, is done first by the other process: the first one is still the one named."""
    verifier, _ = qwen3_chat
    monkeypatch.setattr(tokenization, "CHUNK_LINES", 4)
    good = [json.dumps(row).encode() for row in conversation_set("qwen3")[:6]]
    bad = [raw for raw, reason in EVERY_BAD_ROW if reason == "malformed"][:4]
    data = tmp_path / "chat.jsonl"
    data.write_bytes(b"\n".join(good[:3] + [b"{not json"] + bad + good[3:]) + b"\n")
    for processes in (1, 2):
        with pytest.raises(UserError, match=rf"^{re.escape(str(data))}:4: not valid JSON"):
            tokenize_with(verifier, data, processes, "fail")


def dry_run_commands(work: Path, cores: int, config: dict) -> str:
    """The shell commands a dry-run of vocab_map prints (Snakemake's API, in this process)."""
    from snakemake.api import SnakemakeApi
    from snakemake.settings.types import (
        ConfigSettings,
        DAGSettings,
        OutputSettings,
        ResourceSettings,
        StorageSettings,
    )

    (work / "test_config.yaml").write_text(yaml.safe_dump(config))
    out = io.StringIO()
    with contextlib.redirect_stderr(out), contextlib.redirect_stdout(out):
        with SnakemakeApi(OutputSettings(printshellcmds=True)) as api:
            workflow = api.workflow(
                resource_settings=ResourceSettings(cores=cores),
                config_settings=ConfigSettings(configfiles=[work / "test_config.yaml"]),
                storage_settings=StorageSettings(),
                snakefile=work / "Snakefile",
                workdir=work,
            )
            dag = workflow.dag(dag_settings=DAGSettings(targets={"vocab_map"}))
            dag.execute_workflow(executor="dryrun")
    return out.getvalue()


@pytest.mark.workflow
@pytest.mark.parametrize("cores, config, expected", [(3, {}, 3), (3, {"num_processes": 1}, 1)])
def test_the_rule_gives_prepare_the_jobs_threads(tmp_path, cores, config, expected):
    """prepare's processes are the job's threads: every core it is given, or
    prepare.num_processes."""
    work = copy_workflow(tmp_path / "work")
    out = dry_run_commands(work, cores, {"prepare": config})
    command = next(line for line in out.splitlines() if "workflow_scripts.stages.prepare" in line)
    assert f"--num-processes {expected} " in command, command
