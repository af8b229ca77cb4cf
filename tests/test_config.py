"""Config validation, the JSON schema, and the contract between rules and scripts."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import typing
from pathlib import Path
from typing import Literal

import pytest
import yaml
from snakemake.utils import validate

from workflow_scripts.lib.workflow import cli
from workflow_scripts.lib.workflow.config import (
    ConfigError,
    json_schema,
    layered,
    load_config,
    load_config_files,
)
from workflow_scripts.lib.workflow.config import main as config_main
from workflow_scripts.lib.workflow.registry import STAGES

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted(ROOT.glob("config*.yaml"))


def test_example_configs_exist():
    names = [c.name for c in CONFIGS]
    assert "config.yaml" in names and len(names) >= 2, names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_are_valid(path):
    raw = yaml.safe_load(path.read_text())
    load_config(raw, source=path.name)
    validate(dict(raw), str(ROOT / "config.schema.json"))


def test_schema_file_is_current():
    committed = json.loads((ROOT / "config.schema.json").read_text())
    assert committed == json_schema(), (
        "config.schema.json is stale: "
        "python -m workflow_scripts.lib.workflow.config --schema > config.schema.json"
    )


def test_schema_documents_every_parameter():
    schema = json_schema()
    for name, model in schema["$defs"].items():
        if "properties" not in model:  # a list of sources: its items are checked as models
            assert model.get("description"), f"{name} has no description"
            continue
        for key, prop in model["properties"].items():
            assert prop.get("description"), f"{name}.{key} has no description"


@pytest.mark.parametrize(
    "raw, expected",
    [
        (
            {"prepare": {"max_seqlen": 10}},
            r"'prepare\.max_seqlen'.*did you mean 'prepare\.max_seq_len_tokens'",
        ),
        ({"vocab": {"draft_vocab_sise": 10}}, r"did you mean 'vocab\.draft_vocab_size'"),
        ({"extrakt": {}}, r"unknown config key 'extrakt'.*did you mean 'extract'"),
        ({"train": {"learning_rate": "fast"}}, r"'train\.learning_rate' = 'fast'.*valid number"),
        (
            {"vocab": {"draft_vocab_size": 0}},
            r"'vocab\.draft_vocab_size' = 0.*greater than or equal to 1",
        ),
        (
            {"prepare": {"on_bad_row": "ignore"}},
            r"'prepare\.on_bad_row' = 'ignore'.*'fail' or 'skip'",
        ),
        ({"chat_data": "my.jsonl"}, r"'eval_prompts' is required when 'chat_data' is set"),
        (
            {"train": {"draft_attention": "mla", "fc_norm": True}},
            r"train\.fc_norm with train\.draft_attention mla.*set train\.fc_norm: false",
        ),
        ({"train": {"loss": "ce"}}, r"'train\.loss' = 'ce'.*'kl', 'tv', 'lk_alpha' or 'lk_hybrid'"),
        (
            {"train": {"draft_attention": "mla", "num_draft_layers": 2}},
            r"train\.num_draft_layers above 1 with train\.draft_attention mla.*num_draft_layers: 1",
        ),
        (
            {"train": {"draft_attention": "mla", "draft_layer": "qwen3"}},
            r"train\.draft_layer qwen3 with train\.draft_attention mla.*train\.draft_layer: llama",
        ),
        (
            {"train": {"draft_layer": "gemma"}},
            r"'train\.draft_layer' = 'gemma'.*'llama' or 'qwen3'",
        ),
        (
            {"train": {"num_draft_layers": 9}},
            r"'train\.num_draft_layers' = 9.*less than or equal to 8",
        ),
        (
            {"train": {"ttt_positions": "accepted"}},
            r"'train\.ttt_positions' = 'accepted'.*'all' or 'accepted_chain'",
        ),
        (
            {"train": {"topk_loss_weight": -1}},
            r"'train\.topk_loss_weight' = -1.*greater than or equal to 0",
        ),
        (
            {"train": {"sliding_window_tokens": 3}},
            r"train\.sliding_window_tokens 3 is not above the draft's steps \(3",
        ),
        (
            {"train": {"sliding_window_tokens": 64, "draft_attention": "mla"}},
            r"train\.sliding_window_tokens with train\.draft_attention mla",
        ),
        (
            {"evaluate": {"context_buckets_tokens": [512, 4096]}},
            r"context_buckets_tokens ends at 4096, past max_model_len_tokens \(2048\)",
        ),
        (
            {"evaluate": {"context_buckets_tokens": [512, 256]}},
            r"context_buckets_tokens \[512, 256\]: .* increasing",
        ),
        (
            {"evaluate": {"concurrency": [4, 1]}},
            r"concurrency \[4, 1\]: each at least 1 and increasing, or \[\] for none",
        ),
        (
            {"prepare": {"max_seq_len_tokens": 4096}},
            r"prepare\.max_seq_len_tokens 4096 lets a sample reach extract\.max_model_len_tokens "
            r"4096.*to 4095 or below",
        ),
    ],
)
def test_bad_config_names_key_and_fix(raw, expected):
    with pytest.raises(ConfigError) as err:
        load_config(raw)
    assert re.search(expected, str(err.value)), str(err.value)


def _stage_files(stage: str) -> dict:
    """Placeholder file values for a stage's IO fields (list fields get two paths)."""
    files = {}
    for name, field in STAGES[stage].io.model_fields.items():
        if field.annotation is int:
            files[name] = 1
        elif typing.get_origin(field.annotation) is Literal:  # a wildcard of a few values
            files[name] = typing.get_args(field.annotation)[-1]
        elif "list" in str(field.annotation):
            files[name] = [f"a/{name}_0", f"a/{name}_1"]
        else:
            files[name] = f"dir with space/{name}"
    return files


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
@pytest.mark.parametrize("stage", sorted(STAGES))
def test_rendered_command_parses_with_the_scripts_parser(path, stage):
    """Every rule's command line, for every shipped config, parses with the script's own parser
    into exactly the configured values: a renamed or retyped field cannot pass."""
    cfg = load_config(yaml.safe_load(path.read_text()))
    spec = STAGES[stage]
    params = getattr(cfg, spec.config_key) if spec.config_key else None
    files = _stage_files(stage)
    io, parsed = cli.parse(stage, shlex.split(cli.render(stage, params, files)))
    assert parsed == params
    for name, value in files.items():
        got = getattr(io, name)
        assert [str(v) for v in got] == value if isinstance(value, list) else str(got) == str(value)


def test_renderer_refuses_rule_missing_a_file():
    with pytest.raises(ValueError, match="does not name stats"):
        cli.render(
            "prepare",
            load_config({}).prepare,
            {"chat_data": "a", "verifier": "b", "tokenized": "c"},
        )


def test_script_refuses_unknown_or_missing_flag():
    """The real entry point (argparse) rejects a wrong flag before doing anything."""
    base = [sys.executable, "-m", "workflow_scripts.stages.prepare"]
    args = shlex.split(cli.render("prepare", load_config({}).prepare, _stage_files("prepare")))
    wrong = [a.replace("--max-seq-len-tokens", "--max-seqlen") for a in args]
    out = subprocess.run(base + wrong, cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 2 and "--max-seq-len-tokens" in out.stderr, out.stderr
    bad_value = [a if a != "512" else "lots" for a in args]
    bad_value[bad_value.index("--max-seq-len-tokens") + 1] = "lots"
    out = subprocess.run(base + bad_value, cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 2 and "--max-seq-len-tokens" in out.stderr, out.stderr


def test_rules_type_no_flags():
    """Flags come from the stage definitions only: no '--name' appears in rules/ or Snakefile."""
    for path in [ROOT / "Snakefile", *sorted((ROOT / "rules").glob("*.smk"))]:
        text = "\n".join(
            line for line in path.read_text().splitlines() if not line.lstrip().startswith("#")
        )
        flags = re.findall(r"\s--[a-z][a-z0-9-]+", text)
        assert not flags, f"{path.name} types flags by hand: {flags}"


@pytest.mark.parametrize("stage", [s for s in STAGES if STAGES[s].params is not None])
def test_every_setting_says_whether_it_changes_the_result(stage):
    """Execution settings are fields of the stage, each with its reason; the schema shows the
    effect of every field; job-layout settings are execution settings."""
    params = STAGES[stage].params
    assert set(params.EXECUTION) <= set(params.model_fields), set(params.EXECUTION) - set(
        params.model_fields
    )
    assert all(reason.strip() for reason in params.EXECUTION.values())
    assert set(params.JOB_LAYOUT) <= set(params.EXECUTION)
    schema = json_schema()["$defs"][params.__name__]["properties"]
    assert {name: prop["effect"] for name, prop in schema.items()} == {
        name: params.effect(name) for name in params.model_fields if name not in params.SHARED
    }
    for name in params.SHARED:  # set once at the top level, a result setting of each stage
        assert name in json_schema()["properties"] and params.effect(name) == "result"
    settings = params().result_settings()
    assert set(settings) == {n for n in params.model_fields if params.effect(n) == "result"}


def test_readme_lists_the_execution_settings_of_each_stage():
    readme = (ROOT / "docs" / "configuration.md").read_text()
    table = readme.split("The execution settings:", 1)[1].split("\n\n", 2)[1]
    listed = {
        row.split("|")[1].strip(): set(re.findall(r"`(\w+)`", row.split("|")[2]))
        for row in table.splitlines()[2:]
    }
    expected = {s: set(STAGES[s].params.EXECUTION) for s in STAGES if STAGES[s].config_key == s}
    assert listed == {s: names for s, names in expected.items() if names}


def test_config_files_layer_as_snakemake_layers_them(tmp_path, capsys):
    """Each config file over the ones before it, mappings merged key by key; the validator takes
    the files as `snakemake --configfile` does and names the file set with a bad key."""
    assert layered({"a": {"b": 1, "c": 2}, "d": [1]}, {"a": {"b": 3}, "d": [2], "e": 4}) == {
        "a": {"b": 3, "c": 2},
        "d": [2],
        "e": 4,
    }
    mine = tmp_path / "mine.yaml"
    mine.write_text("train:\n  epochs: 7\nevaluate:\n  concurrency: [2]\n")
    cfg = load_config_files([ROOT / "config.yaml", mine])
    shipped = load_config(yaml.safe_load((ROOT / "config.yaml").read_text()))
    assert (cfg.train.epochs, cfg.evaluate.concurrency) == (7, [2])
    assert cfg.train.learning_rate == shipped.train.learning_rate != 7
    assert config_main([str(ROOT / "config.yaml"), str(mine)]) == 0
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  epoch: 7\n")
    assert config_main([str(ROOT / "config.yaml"), str(bad)]) == 1
    err = capsys.readouterr().err
    assert "bad.yaml" in err and "train.epoch" in err and "epochs" in err, err
