"""data: the chat data's sources (config key ``chat_data``) -> one JSON Lines file of
conversations, mixed by each source's ``rows`` or ``weight`` with ``data.seed``
(``lib/data/mixture.py``), and its statistics: per source the rows it has and the rows taken, its
layout, and the rows that could not be read.

Every row keeps where it came from (``source_row``: ``file:row`` or ``owner/name/split:row``), so
that regenerate and prepare name it there when it is a bad row. Hub datasets are read at the
commit the plan pinned (``lib/data/hub.py``). A small CPU job: no torch, no vLLM.
"""

from __future__ import annotations

import json
import logging

from workflow_scripts.lib.common import Progress, UserError, atomic_path, run_main, write_json
from workflow_scripts.lib.data.files import source_files
from workflow_scripts.lib.data.mixture import mix
from workflow_scripts.lib.workflow import cli
from workflow_scripts.lib.workflow.code_inputs import made_by

log = logging.getLogger("eagle3")


def main() -> None:
    io, p = cli.parse("data")
    sources = p.chat_data.root
    if not sources:
        raise UserError("config key 'chat_data' names no source")
    files = [
        source_files(s.path, f"chat_data[{i}].path") if s.path is not None else []
        for i, s in enumerate(sources)
    ]
    for source, paths in zip(sources, files):
        log.info(
            "data: source '%s': %s",
            source.label,
            (
                f"hub {source.hub} ({source.subset or 'default'}, {source.split}) at {source.revision}"
                if source.hub
                else f"{len(paths)} file(s) from {source.path}"
            ),
        )
    progress = Progress("data", total=None, interval_s=p.progress_interval_s)
    with atomic_path(io.mixture) as tmp, open(tmp, "w", encoding="utf-8") as out:
        stats = mix(sources, files, p.seed, p.num_rows, out, progress)
        if stats["rows"] == 0:
            raise UserError("the sources of chat_data hold no row")
    progress.log()
    write_json(io.stats, {**stats, "made_by": made_by("data")})
    log.info(
        "data: %d rows: %s",
        stats["rows"],
        json.dumps({s["name"]: s["rows_taken"] for s in stats["sources"]}),
    )


if __name__ == "__main__":
    run_main(main)
