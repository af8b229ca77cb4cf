"""config.yaml: its typed model, validation with helpful errors, and its JSON schema.

``python -m workflow_scripts.lib.workflow.config --schema`` prints the schema (also kept as
``config.schema.json``); ``python -m workflow_scripts.lib.workflow.config config.yaml mine.yaml``
validates config files layered as ``snakemake --configfile config.yaml mine.yaml`` layers them.
"""

from __future__ import annotations

import argparse
import difflib
import fnmatch
import json
import sys
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Callable

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    create_model,
    field_validator,
    model_validator,
)

from workflow_scripts.lib.workflow.params_base import SIZE, ChatTemplateSettings, size_bytes
from workflow_scripts.lib.workflow.registry import STAGES
from workflow_scripts.lib.workflow.sources import ChatData, EvalPrompts

# settings set once at the top level and shared by the stages whose definitions list them in
# SHARED (the stages get them through their own section, so each records them)
SHARED_SETTINGS = {
    "chat_template": ChatTemplateSettings,
    "chat_data": ChatData,
    "eval_prompts": EvalPrompts,
}

# The page that explains a key needing more than its line of description, by the key's dotted
# name ("section.key"; fnmatch patterns, the first that matches counts). The schema's description
# of the key ends with it; docs/configuration.md shows the same table, and tests/test_docs.py
# checks that the two agree and that every page and heading exists.
_GPUS = "docs/gpu-and-slurm.md#installing-on-gpu-machines"
_BUDGET = "docs/hidden-states.md#a-disk-budget"
_RECIPE = "docs/training.md#the-recipes-settings"
_REGENERATE = "docs/chat-data.md#regenerating-the-answers-with-the-verifier-self-distillation"
DOCS = {
    "verifier": "README.md#your-own-verifier-and-data",
    "chat_data*": "docs/chat-data.md#sources-and-mixtures",
    "data.seed": "docs/chat-data.md#sources-and-mixtures",
    "data.num_rows": "docs/chat-data.md#sources-and-mixtures",
    "eval_prompts*": "docs/evaluation-and-quality.md#evaluation-sets",
    "gpus_per_node": "docs/verifier-families.md#checked-at-dry-run",
    "*.pipeline_parallel_size": "docs/verifier-families.md#checked-at-dry-run",
    "chat_template.trust_remote_code": "docs/verifier-families.md#verifiers-as-they-ship",
    "chat_template.*": "docs/chat-data.md#template-arguments",
    "prepare.on_bad_row": "docs/chat-data.md#bad-rows-and-long-rows",
    "prepare.max_seq_len_tokens": "docs/chat-data.md#bad-rows-and-long-rows",
    "*.num_jobs": "profiles/slurm/README.md#how-extraction-scales-over-nodes",
    "*.use_gpus": _GPUS,
    "*.tensor_parallel_size": _GPUS,
    "train.num_gpus": _GPUS,
    "gpu_memory_bytes": _GPUS,
    "*.gpu_memory_utilization": _GPUS,
    "*.kv_cache_memory_bytes": _GPUS,
    "*.enforce_eager": _GPUS,
    "*.max_model_len_tokens": "docs/gpu-and-slurm.md#lengths",
    "train.report_to": "docs/training.md#training-curves",
    "train.wandb_*": "docs/training.md#training-curves",
    "train.norm_before_residual": "docs/gpu-and-slurm.md#serving-on-sglang-and-tensorrt-llm",
    "train.num_nodes": "docs/training.md#several-nodes",
    "*.num_nodes": "docs/gpu-and-slurm.md#a-verifier-larger-than-one-node",
    **{
        f"regenerate.{key}": _REGENERATE
        for key in ("enabled", "temperature", "top_p", "max_new_tokens_per_turn", "on_*")
    },
    "extract.storage_dtype": "docs/hidden-states.md#storage-dtypes",
    "extract.disk_margin": "docs/hidden-states.md#disk-plan",
    "extract.disk_budget": _BUDGET,
    "extract.share_training_gpus": _BUDGET,
    "train.shuffle_window_shards": _BUDGET,
    "train.ttt_steps": "docs/training.md#training-time-test",
    "train.micro_batch_budget_tokens": "docs/training.md#training-time-test",
    "train.num_speculative_tokens": "docs/training.md#acceptance-in-training-and-the-draft-kept",
    "train.select_by": "docs/training.md#acceptance-in-training-and-the-draft-kept",
    **{
        f"train.{key}": _RECIPE
        for key in (
            "loss", "lk_eta", "optimizer", "muon_*", "lr_schedule", "min_lr_ratio", "fc_norm",
            "norm_before_fc", "norm_output", "freeze_lm_head", "final_norm_init", "aux_noise",
            "loss_positions", "ttt_step_loss_decay", "topk_loss_*", "ttt_positions",
            "num_draft_layers", "draft_layer",
        )
    },  # fmt: skip
    "train.init_from": "docs/training.md#starting-from-an-existing-draft",
    "train.sliding_window_tokens": "docs/training.md#a-sliding-window",
    "train.draft_attention": "docs/verifier-families.md#mla-drafts-deepseek-kimi",
    "train.checkpoint_every_steps": "README.md#after-a-crash",
    **{
        f"evaluate.{key}": "docs/evaluation-and-quality.md#evaluation"
        for key in ("num_speculative_tokens", "max_new_tokens", "sampled_temperature", "ngram_*")
    },
    "evaluate.context_buckets_tokens": "docs/evaluation-and-quality.md#acceptance-by-context-length",
    **{
        f"evaluate.{key}": "docs/evaluation-and-quality.md#serving-speed"
        for key in ("concurrency", "speed_pass_min_s")
    },
    "demo.corpus": "docs/evaluation-and-quality.md#draft-quality",
}


def docs_page(key: str) -> str | None:
    """The page (path#heading, from the repository's root) that explains config key ``key``
    ("section.key" or a top-level key), or None where its description says it all."""
    return next((page for pattern, page in DOCS.items() if fnmatch.fnmatchcase(key, pattern)), None)


_SIZE = rf"^\s*{SIZE}\s*$"


class _TopLevel(BaseModel):
    """config.yaml's keys that are no stage's: the inputs and where results go."""

    model_config = ConfigDict(extra="forbid", validate_default=True)

    verifier: str | None = Field(
        None,
        description="Hugging Face model directory of the verifier. null builds the embedded "
        "tiny demo verifier.",
    )
    results_dir: str = Field("results", description="Where every output of the workflow goes.")
    gpus_per_node: int | None = Field(
        None,
        ge=1,
        description="GPUs on one node of your cluster: a GPU job (it runs on one node) asking "
        "more is refused at dry-run. null: not checked; on one machine, snakemake --resources "
        "gpu=N is checked.",
    )
    gpu_memory_bytes: Annotated[int, Field(ge=1)] | Annotated[str, Field(pattern=_SIZE)] | None = (
        Field(
            None,
            description="Memory of one GPU of the nodes the jobs run on: bytes, or a size like "
            "'80GB' (H100 80GB) or '141GB' (H200). Set: the dry-run checks each engine on GPUs "
            "against it (the verifier's weights on tensor_parallel_size x "
            "pipeline_parallel_size GPUs within gpu_memory_utilization of it, and room left for "
            "one sequence's KV cache). null: not known at dry-run; each job checks against its "
            "own GPUs before its model loads.",
        )
    )

    @field_validator("gpu_memory_bytes", mode="before")
    @classmethod
    def _size_in_bytes(cls, value):
        return size_bytes(value) if isinstance(value, str) else value

    @model_validator(mode="after")
    def _cross_key_checks(self):
        for check in CROSS_KEY:
            problem = check(self)
            if problem:
                raise ValueError(problem)
        return self


# The refusals of a combination of keys: each takes the whole config and returns why it is
# refused, or None; the config's model raises the first, so a bad combination fails when the
# config loads (the dry-run's other checks of the config: lib/workflow/checks.py).


def eval_prompts_named(cfg: WorkflowConfig) -> str | None:
    """Your own chat data needs your own held-out prompts."""
    if cfg.data.chat_data.root and not cfg.evaluate.eval_prompts.root:
        return (
            "config key 'eval_prompts' is required when 'chat_data' is set: name held-out "
            "prompts (a JSONL of rows with 'messages' ending in a user turn, or 'prompt') or "
            "a public set ({set: humaneval})"
        )
    return None


def demo_prompts_with_the_demo_verifier(cfg: WorkflowConfig) -> str | None:
    """The demo's held-out prompts exist only for the embedded default's verifier."""
    demo = [s.label for s in cfg.evaluate.eval_prompts.root if s.set == "demo"]
    if demo and cfg.verifier is not None:
        return (
            f"config key 'eval_prompts': set demo ({demo[0]}) is the embedded default's "
            "held-out prompts, built only when 'verifier' is null: name your own prompts"
        )
    return None


def samples_fit_the_engine(cfg: WorkflowConfig) -> str | None:
    """A sample extraction would refuse stops the run at extract."""
    longest, engine = cfg.prepare.max_seq_len_tokens, cfg.extract.max_model_len_tokens
    if longest >= engine and cfg.extract.on_too_long == "fail":
        return (
            f"prepare.max_seq_len_tokens {longest} lets a sample reach "
            f"extract.max_model_len_tokens {engine}, and extraction keeps one position for "
            "the token the engine generates: the run would stop at extract. Set "
            f"prepare.max_seq_len_tokens to {engine - 1} or below, or raise "
            "extract.max_model_len_tokens (up to the verifier's max_position_embeddings)"
        )
    return None


def disk_budget_on_one_node(cfg: WorkflowConfig) -> str | None:
    """The engine within a disk budget runs beside training, on one node."""
    if cfg.train.num_nodes > 1 and cfg.extract.disk_budget is not None:
        return (
            f"train.num_nodes {cfg.train.num_nodes} with extract.disk_budget: the engine "
            "that computes hidden states within a budget runs beside training on one node. "
            "Over several nodes, extract without a budget (extraction jobs spread over the "
            "nodes), then train: set extract.disk_budget: null, or train.num_nodes: 1"
        )
    return None


CROSS_KEY: tuple[Callable[[WorkflowConfig], str | None], ...] = (
    eval_prompts_named,
    demo_prompts_with_the_demo_verifier,
    samples_fit_the_engine,
    disk_budget_on_one_node,
)


# The whole of config.yaml: the top-level keys, then one section per stage with parameters
# (the stage's typed definition, defaults filled in), in pipeline order.
WorkflowConfig = create_model(
    "WorkflowConfig",
    __base__=_TopLevel,
    __doc__="The whole of config.yaml.",
    **{
        spec.config_key: (spec.params, Field(default_factory=spec.params))
        for spec in STAGES.values()
        if spec.config_key is not None
    },
)


class ConfigError(ValueError):
    """A config that cannot run; the message says which key, what is wrong and how to fix it."""


def _model_at(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    model: type[BaseModel] = WorkflowConfig
    if loc and loc[0] in SHARED_SETTINGS:
        model, loc = SHARED_SETTINGS[loc[0]], loc[1:]
    for part in loc:
        if isinstance(part, int) and "root" in model.model_fields:  # an item of a list of models
            model = typing.get_args(model.model_fields["root"].annotation)[0]
            continue
        field = model.model_fields.get(str(part))
        if field is None or not (
            isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)
        ):
            return None
        model = field.annotation
    return model


def _dotted(loc: tuple[Any, ...]) -> str:
    """A location as the config names it: section.key, an item of a list as key[i]."""
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")


def _union_member(loc: tuple[Any, ...]) -> bool:
    """Whether ``loc`` ends with the tag of a union's member: pydantic reports a value that fits
    no member of a union (``int | Literal["auto"] | None``) once per member."""
    if len(loc) < 2 or not isinstance(loc[-1], str):
        return False
    model = _model_at(loc[:-2])
    field = model.model_fields.get(str(loc[-2])) if model is not None else None
    return field is not None and typing.get_origin(field.annotation) in (
        typing.Union,
        types.UnionType,
    )


def _members_merged(errors: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``errors`` with those of one value against each member of a union made one error of the
    key, saying what each member would take."""
    merged: dict[tuple[Any, ...], dict[str, Any]] = {}
    for err in errors:
        loc = tuple(err["loc"])
        if not _union_member(loc):
            merged[loc + (len(merged),)] = err
            continue
        first = merged.setdefault(loc[:-1], {**err, "loc": loc[:-1], "msg": ""})
        msg = err["msg"].removeprefix("Input should ")
        first["msg"] = f"{first['msg']} or {msg}" if first["msg"] else f"Input should {msg}"
    return list(merged.values())


def _describe(err: dict[str, Any], source: str) -> str:
    loc = tuple(err["loc"])
    if len(loc) > 1 and loc[1] in SHARED_SETTINGS:  # a shared setting: named where it is set
        loc = loc[1:]
    key = _dotted(loc)
    if err["type"] == "extra_forbidden":
        parent = _model_at(loc[:-1])
        valid = list(parent.model_fields) if parent else []
        close = difflib.get_close_matches(str(loc[-1]), valid, n=1, cutoff=0.5)
        prefix = _dotted(loc[:-1])
        hint = (
            f"did you mean '{prefix + '.' if prefix else ''}{close[0]}'?"
            if close
            else f"valid keys here: {', '.join(valid)}"
        )
        return f"{source}: unknown config key '{key}': {hint}"
    if not loc:  # a check across keys: its message names them
        return f"{source}: {err['msg'].removeprefix('Value error, ')}"
    value = err.get("input")
    return f"{source}: config key '{key}' = {value!r}: {err['msg']}"


def _share(raw: dict[str, Any], source: str) -> dict[str, Any]:
    """``raw`` with each shared top-level setting copied into the sections of the stages that
    take it; a ConfigError where a section sets one itself."""
    raw = dict(raw or {})
    for key in SHARED_SETTINGS:
        value = raw.pop(key, None)
        for name, spec in STAGES.items():
            if spec.params is None or spec.config_key != name or key not in spec.params.SHARED:
                continue  # (a stage that reads another's section: that one's)
            section = raw.get(spec.config_key)
            if isinstance(section, dict) and key in section:
                raise ConfigError(
                    f"invalid configuration:\n  {source}: config key '{spec.config_key}.{key}': "
                    f"set it once, at the top level ('{key}:'), for every stage that uses it"
                )
            if value is not None:
                raw[spec.config_key] = {
                    **(section if isinstance(section, dict) else {}),
                    key: value,
                }
    return raw


def load_config(raw: dict[str, Any], source: str = "config") -> WorkflowConfig:
    """Validate a config dict (as Snakemake loaded it); raise ConfigError naming every bad key."""
    try:
        return WorkflowConfig.model_validate(_share(raw, source))
    except ValidationError as exc:
        errors = _members_merged(exc.errors())
        lines = list(dict.fromkeys(_describe(e, source) for e in errors))
        raise ConfigError(
            "invalid configuration:\n  " + "\n  ".join(lines) + "\n(see config.schema.json for "
            "every key, its type and its default, and docs/configuration.md)"
        ) from None


def layered(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``over`` layered over ``base`` as Snakemake layers config files (``--configfile`` over
    config.yaml, and each over the ones before it): mappings merged key by key, any other value
    replaced."""
    out = dict(base)
    for key, value in over.items():
        both = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = layered(out[key], value) if both else value
    return out


def layered_files(paths: list[Path]) -> dict[str, Any]:
    """The config files layered as Snakemake layers them (each over the ones before it), as plain
    data, not yet validated."""
    import yaml

    raw: dict[str, Any] = {}
    for path in paths:
        raw = layered(raw, yaml.safe_load(Path(path).read_text()) or {})
    return raw


def load_config_files(paths: list[Path]) -> WorkflowConfig:
    """The config a run with these config files gets (each layered over the ones before it),
    validated; a ConfigError naming the files and every bad key."""
    return load_config(layered_files(paths), source=" + ".join(map(str, paths)))


def _items(schema: dict[str, Any], definition: dict[str, Any]) -> dict[str, Any] | None:
    """The properties of the sources a list of sources takes, or None."""
    refs = [a["$ref"] for a in definition.get("anyOf", []) if "$ref" in a]
    return schema["$defs"][refs[0].rsplit("/", 1)[1]].get("properties") if refs else None


def keyed_properties(schema: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """Every key of config.yaml in ``schema`` by its dotted name (``train.loss``; a source's
    keys as ``chat_data.path``) with its property, the top-level keys included."""
    defs = {
        key: schema["$defs"][prop["$ref"].rsplit("/", 1)[1]]
        for key, prop in schema["properties"].items()
        if "$ref" in prop
    }
    sections = {k for k, d in defs.items() if d.get("properties")}
    keys = [(key, prop) for key, prop in schema["properties"].items() if key not in sections]
    for key, definition in defs.items():
        fields = definition.get("properties") or _items(schema, definition) or {}
        keys += [(f"{key}.{name}", prop) for name, prop in fields.items()]
    return keys


def json_schema() -> dict[str, Any]:
    schema = WorkflowConfig.model_json_schema()
    for key, model in SHARED_SETTINGS.items():  # top-level keys, out of the stages' sections
        sub = model.model_json_schema()
        schema["$defs"].update(sub.pop("$defs", {}))  # a list's item models, where it refers
        schema["$defs"][model.__name__] = sub
        schema["properties"][key] = {
            "$ref": f"#/$defs/{model.__name__}",
            "description": (model.__doc__ or "").strip().replace("\n    ", " "),
        }
    for key, prop in keyed_properties(schema):
        if page := docs_page(key):
            prop["description"] = f"{prop.get('description', '').rstrip()} More: {page}".lstrip()
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", **schema}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "config", nargs="*", type=Path, help="config files to validate, each over the ones before"
    )
    parser.add_argument("--schema", action="store_true", help="print the JSON schema")
    args = parser.parse_args(argv)
    if args.schema:
        print(json.dumps(json_schema(), indent=2))
        return 0
    if not args.config:
        parser.error("give config files or --schema")
    try:
        load_config_files(args.config)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 1
    print(f"{' + '.join(map(str, args.config))}: valid")
    return 0


if __name__ == "__main__":
    sys.exit(main())
