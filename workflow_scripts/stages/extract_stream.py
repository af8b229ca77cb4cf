"""extract_stream: the engine that computes hidden-state shards for training within
``extract.disk_budget``, in the order of training's schedule (``lib/hidden_states/stream_producer.py``).

Started by the train stage (never by a rule of its own), with the command its rule renders
from the extract settings; it runs until every shard of the schedule is written.
"""

from __future__ import annotations

from workflow_scripts.lib.common import run_main
from workflow_scripts.lib.hidden_states.stream_producer import produce
from workflow_scripts.lib.verifier import engine
from workflow_scripts.lib.workflow import cli


def main() -> None:
    io, p = cli.parse("extract_stream")
    engine.check_devices(p, "extract", vllm=p.backend == "vllm", verifier=io.verifier)
    produce(io, p)


if __name__ == "__main__":
    run_main(main)
