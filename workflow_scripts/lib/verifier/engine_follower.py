"""The follower of an engine over several nodes: on each node of the stage's SLURM job but the
first, started there by the nodes launcher (``lib/workflow/nodes.py``, with srun), it starts the
node's vLLM workers for each engine the stage publishes on the first node, and stops them when
that engine closes (``engine_nodes.py`` says how the two meet).

    python -m workflow_scripts.lib.verifier.engine_follower
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from workflow_scripts.lib.common import UserError
from workflow_scripts.lib.verifier.engine import bind_cpu_workers
from workflow_scripts.lib.verifier.engine_nodes import (
    ENV_ARGS,
    ENV_HOSTS,
    ENV_NODES,
    POLL_S,
    read_published,
)

log = logging.getLogger("eagle3")


def node_rank(environ: dict[str, str]) -> int:
    """This node's rank in the engine: its place in the job's node list (SLURMD_NODENAME, which
    srun gives each task, among the launcher's hosts)."""
    hosts = environ.get(ENV_HOSTS, "").split(",")
    name = environ.get("SLURMD_NODENAME", "")
    if name not in hosts or hosts.index(name) == 0:
        raise UserError(
            f"this follower runs on node {name or '?'}, which is not one of the engine's other "
            f"nodes ({', '.join(hosts[1:]) or 'none'}): it is started by the nodes launcher, "
            "with srun, on every node of the job but the first"
        )
    return hosts.index(name)


def bind_local_workers(kwargs: dict[str, Any]) -> None:
    """On the CPU, this node's workers each bound to a share of its cores, as on node 0
    (``engine.make_llm``; one worker: vLLM's own binding)."""
    local = kwargs["tensor_parallel_size"] // kwargs["nnodes"]
    if local > 1:
        bind_cpu_workers(local)


def start_workers(kwargs: dict[str, Any], rank: int):
    """This node's part of the engine: its workers, as vLLM's headless mode starts them."""
    from vllm.config.kv_transfer import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    args = dict(kwargs, node_rank=rank)
    if isinstance(args.get("kv_transfer_config"), dict):  # as vllm.LLM converts it
        args["kv_transfer_config"] = KVTransferConfig(**args["kv_transfer_config"])
    args.setdefault("disable_log_stats", True)
    config = EngineArgs(**args).create_engine_config(UsageContext.ENGINE_CONTEXT, headless=True)
    return MultiprocExecutor(config, monitor_workers=True)


def stop_workers(executor) -> None:
    """The executor shut down, and any worker still alive then killed (a shutdown cut short by a
    signal leaves it waiting on them)."""
    procs = [w.proc for w in getattr(executor, "workers", None) or []]
    executor.shutdown()
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join(5)


def follow(environ: dict[str, str] | None = None) -> None:
    """Start this node's workers for each engine node 0 publishes, and stop them when it closes;
    ends when told to (SIGTERM, from the launcher once the stage is done). A worker that dies is
    an error."""
    env = dict(os.environ if environ is None else environ)
    rank = node_rank(env)
    where = f"node {rank} ({env.get('SLURMD_NODENAME')}) of {env[ENV_NODES]}"
    path = Path(env[ENV_ARGS])

    def on_signal(signum, frame):  # the launcher is done: out of any wait, workers stopped
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    log.info("%s: waiting for the engine's arguments from node 0 (%s)", where, path)
    executor, current, done = None, None, set()
    try:
        while True:
            published = read_published(path)
            if executor is not None and published.get("id") != current:
                log.info("%s: engine %s closed on node 0; stopping its workers", where, current)
                stop_workers(executor)
                executor, current = None, None
            if executor is None and published.get("id") and published["id"] not in done:
                current = published["id"]
                done.add(current)
                kwargs = published["kwargs"]
                if not kwargs.get("tensor_parallel_size") or "nnodes" not in kwargs:
                    raise UserError(f"{path}: not an engine's arguments over several nodes")
                log.info("%s: starting its workers for engine %s", where, current)
                if not _on_gpus():
                    bind_local_workers(kwargs)
                executor = start_workers(kwargs, rank)
                log.info("%s: workers ready", where)
            if executor is not None and executor.is_failed:
                raise RuntimeError(
                    f"{where}: a worker of engine {current} died (its log lines above say why)"
                )
            time.sleep(POLL_S)
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # stopping already
        if executor is not None:
            stop_workers(executor)
        log.info("%s: stopped", where)


def _on_gpus() -> bool:
    from vllm.platforms import current_platform

    return not current_platform.is_cpu()


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    try:
        follow()
    except UserError as exc:
        log.error("error: %s", exc)
        sys.exit(2)


if __name__ == "__main__":
    main()
