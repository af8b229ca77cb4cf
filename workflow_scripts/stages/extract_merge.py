"""extract_merge: the extraction jobs' part manifests -> one manifest of all shards.

``manifest.merge_parts`` checks that the parts agree (same data, verifier, layers, dtype, shard size and job count), that
every shard index appears exactly once and that every shard file is there with the size its part
recorded. Shard paths in the manifest are relative to the manifest's directory.
"""

from __future__ import annotations

import logging
from pathlib import Path

from workflow_scripts.lib.common import run_main
from workflow_scripts.lib.hidden_states.manifest import merge_parts
from workflow_scripts.lib.hidden_states.records import ExtractPart
from workflow_scripts.lib.workflow import cli

log = logging.getLogger("eagle3")


def main() -> None:
    io, _ = cli.parse("extract_merge")
    parts = [(Path(p), ExtractPart.read(p)) for p in io.parts]
    manifest = merge_parts(parts, Path(io.manifest))
    manifest.write(io.manifest)
    log.info(
        "manifest: %d shards, %d samples, %d tokens (%d skipped as too long), %.2f GiB -> %s",
        len(manifest.shards),
        manifest.num_samples,
        manifest.num_tokens,
        manifest.num_skipped_too_long,
        manifest.bytes / 2**30,
        io.manifest,
    )


if __name__ == "__main__":
    run_main(main)
