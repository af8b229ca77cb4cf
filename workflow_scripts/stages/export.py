"""export: the trained draft -> the same draft in the layout SGLang or TensorRT-LLM serves, with
the engine's serve command (``lib/draft/export.py``). Refused, saying why and which settings to
change, where the engine cannot serve the draft as it was trained."""

from __future__ import annotations

import logging

from workflow_scripts.lib.common import UserError, run_main
from workflow_scripts.lib.draft.export import ENGINES, SERVE_SCRIPT, export_draft
from workflow_scripts.lib.workflow import cli

log = logging.getLogger("eagle3")


def main(argv: list[str] | None = None) -> None:
    io, _ = cli.parse("export", argv)
    try:
        written = export_draft(io.draft, io.export, io.engine)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    log.info(
        "export: %s's draft in %s (%s); serve it with %s",
        ENGINES[io.engine],
        io.export,
        ", ".join(written),
        io.export / SERVE_SCRIPT,
    )


if __name__ == "__main__":
    run_main(main)
