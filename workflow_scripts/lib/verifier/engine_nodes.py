"""The verifier's vLLM engine over several nodes (``<stage>.num_nodes`` > 1), for a verifier that no
single node holds: tensor parallelism over the GPUs of every node, vLLM's own multi-node ``mp``
executor (``nnodes``, ``node_rank``, ``master_addr``, ``master_port``), no Ray.

The nodes launcher (``workflow_scripts/lib/workflow/nodes.py``, in the stage's SLURM job of N
nodes) runs the stage itself on the job's first node and a follower on each of the others:

* On the first node, the stage's engine is node 0 (``driver_args``). Before it starts, it
  publishes its whole argument list to a file on the shared file system (``publish``): what the
  other nodes must start their workers with, to the byte (the model, the parallel sizes, the
  extraction connector, the draft served, ...). Only node 0 writes results (the extraction
  connector writes from tensor-parallel rank 0, which is on node 0).
* On every other node, the follower (``engine_follower.py``) waits for that file, starts the
  node's workers with those arguments and its own node rank (vLLM's headless executor, as
  ``vllm serve --headless`` does), and keeps them until the engine that published it closes (the file is removed). A
  stage that runs several engines one after another (evaluate: the verifier alone, with the
  draft, with n-gram) is followed engine by engine. A worker that dies ends the follower with
  an error; the launcher then stops the stage, naming the node.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import uuid
from pathlib import Path
from typing import Any

from workflow_scripts.lib.common import (
    ENGINE_ARGS_ENV,
    ENGINE_HOSTS_ENV,
    ENGINE_MASTER_ADDR_ENV,
    ENGINE_NODES_ENV,
    UserError,
    atomic_path,
)

log = logging.getLogger("eagle3")

ENV_NODES, ENV_HOSTS = ENGINE_NODES_ENV, ENGINE_HOSTS_ENV  # set by the nodes launcher
ENV_MASTER_ADDR, ENV_ARGS = ENGINE_MASTER_ADDR_ENV, ENGINE_ARGS_ENV
POLL_S = 0.5


def free_port(addr: str) -> int:
    """A TCP port free on this node at ``addr`` (node 0's), for the engine's ranks to meet at."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((addr, 0))
        return sock.getsockname()[1]


def driver_args(settings, environ: dict[str, str] | None = None) -> dict[str, Any]:
    """The engine arguments that make this process's engine node 0 of ``settings.num_nodes``,
    from the nodes launcher's environment ({} for one node)."""
    n = settings.num_nodes
    if n == 1:
        return {}
    env = os.environ if environ is None else environ
    section = settings.SECTION
    if env.get(ENV_NODES) != str(n):
        raise UserError(
            f"{section}.num_nodes is {n}: the verifier's engine spans {n} nodes of one SLURM "
            "job, its workers started on the others by the nodes launcher (the rule renders the "
            "command through workflow_scripts.lib.workflow.nodes); here the stage runs without "
            f"it{' (it started one for ' + env[ENV_NODES] + ' nodes)' if ENV_NODES in env else ''}"
            f". Run it through the workflow (snakemake --profile profiles/slurm ...), or set "
            f"{section}.num_nodes: 1"
        )
    return dict(
        nnodes=n, node_rank=0, master_addr=env[ENV_MASTER_ADDR], distributed_executor_backend="mp"
    )


def publish(kwargs: dict[str, Any], environ: dict[str, str] | None = None) -> str:
    """Node 0's engine arguments, with a port free now for its ranks to meet at (``kwargs`` gets
    it), written where the followers wait for them (atomically, with a new id for each engine);
    returns the id."""
    env = os.environ if environ is None else environ
    kwargs["master_port"] = free_port(kwargs["master_addr"])
    engine_id = uuid.uuid4().hex
    path = Path(env[ENV_ARGS])
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        Path(tmp).write_text(json.dumps({"id": engine_id, "kwargs": kwargs}))
    _published["id"] = engine_id
    log.info(
        "engine over %s nodes: its arguments published for the others (%s)", kwargs["nnodes"], path
    )
    return engine_id


_published: dict[str, str | None] = {"id": None}  # what this process published last


def withdraw(environ: dict[str, str] | None = None) -> None:
    """Node 0's engine has closed: the arguments this process published removed, so that the
    followers stop its workers (not those of an engine another process published since)."""
    env = os.environ if environ is None else environ
    if _published["id"] is None or ENV_ARGS not in env:
        return
    path = Path(env[ENV_ARGS])
    if read_published(path).get("id") == _published["id"]:
        path.unlink(missing_ok=True)
    _published["id"] = None


def read_published(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}
