"""Command lines generated from the stage definitions in ``definitions.py``.

``render(stage, params, files)`` is what a rule calls; ``parse(stage)`` is what the script calls.
Both derive every flag from the same pydantic fields, so a flag can't be misspelt on one side.
Every parameter is rendered explicitly and every flag is required: a script never falls back to
a default of its own that disagrees with config.yaml.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import typing
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ValidationError

from workflow_scripts.lib.workflow.definitions import StageParams
from workflow_scripts.lib.workflow.registry import STAGES


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _is_textual(annotation: Any) -> bool:
    """True when a value of this type is passed on the command line as bare text."""
    if annotation in (str, Path):
        return True
    if typing.get_origin(annotation) is Literal:
        return all(isinstance(a, str) for a in typing.get_args(annotation))
    return False


def _encode(value: Any) -> str:
    if isinstance(value, BaseModel):
        return json.dumps(value.model_dump(mode="json"), sort_keys=True)
    if isinstance(value, (str, Path)):
        return str(value)
    if isinstance(value, list) and value and isinstance(value[0], Path):
        return json.dumps([str(v) for v in value])
    return json.dumps(value)


def _decode(annotation: Any, raw: str) -> Any:
    if _is_textual(annotation):
        return raw
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw  # e.g. text for an Optional[str]: pydantic judges the type


def _fields(model: type[BaseModel] | None) -> dict[str, Any]:
    return dict(model.model_fields) if model is not None else {}


def render(stage: str, params: StageParams | None, files: dict[str, Any]) -> str:
    """The script's arguments, shell-quoted: every IO field from ``files`` (a rule's named input,
    output and wildcards, extra names ignored) and every parameter from ``params``."""
    spec = STAGES[stage]
    if (params is None) != (spec.params is None) or (
        params is not None and not isinstance(params, spec.params)
    ):
        raise TypeError(f"stage '{stage}' takes {spec.params}, got {type(params)}")
    args: list[str] = []
    missing = [name for name in spec.io.model_fields if name not in files]
    if missing:
        raise ValueError(
            f"rule for stage '{stage}' does not name {', '.join(missing)} among its input, "
            f"output or wildcards; name them as in "
            f"workflow_scripts/lib/workflow/registry.py:{spec.io.__name__}"
        )
    for name, field in spec.io.model_fields.items():
        value = files[name]
        if typing.get_origin(field.annotation) is list:
            value = [str(v) for v in value]
        elif not isinstance(value, (str, int, Path)):
            value = str(value)
        args += [flag(name), _encode(value)]
    if params is not None:
        for name, field in _fields(spec.params).items():
            value, text = getattr(params, name), _encode(getattr(params, name))
            if isinstance(value, str) and _decode(field.annotation, text) != value:
                text = json.dumps(value)  # text JSON reads otherwise ("123", "null"): quoted
            args += [flag(name), text]
    return shlex.join(args)


def build_parser(stage: str) -> argparse.ArgumentParser:
    spec = STAGES[stage]
    parser = argparse.ArgumentParser(
        prog=f"python -m {spec.module}",
        description=(spec.params or spec.io).__doc__,
        epilog="Every flag is required; rules render them from config.yaml.",
    )
    files = parser.add_argument_group("files")
    for name, field in spec.io.model_fields.items():
        files.add_argument(flag(name), dest=name, required=True, help=field.description)
    if spec.params is not None:
        group = parser.add_argument_group(f"parameters (config key '{spec.config_key}')")
        for name, field in spec.params.model_fields.items():
            group.add_argument(
                flag(name),
                dest=name,
                required=True,
                help=f"{field.description} (default in config: {field.default!r})",
            )
    return parser


def _validate(model: type[BaseModel], values: dict[str, str], parser: argparse.ArgumentParser):
    decoded = {
        name: _decode(field.annotation, values[name]) for name, field in model.model_fields.items()
    }
    try:
        return model.model_validate(decoded)
    except ValidationError as exc:
        parser.error("; ".join(f"{flag(str(e['loc'][0]))}: {e['msg']}" for e in exc.errors()))


def parse(stage: str, argv: list[str] | None = None) -> tuple[Any, Any]:
    """Parse a script's command line into (io, params) models, validated."""
    spec = STAGES[stage]
    parser = build_parser(stage)
    ns = vars(parser.parse_args(sys.argv[1:] if argv is None else argv))
    io = _validate(spec.io, ns, parser)
    params = _validate(spec.params, ns, parser) if spec.params is not None else None
    return io, params
