"""Training over nodes on the CPU: 1 node x 2 processes against 2 nodes x 1 process on this
machine (two torchrun node ranks meeting at 127.0.0.1 through torchrun's static rendezvous, as
the train stage starts them on each node of a SLURM job), in one run. Prints the tokens/s of each
layout, their ratio (the cost of the rendezvous and of gloo over TCP instead of within one
torchrun), and whether both trained the same draft.

    .venv/bin/python benchmarks/bench_train_nodes.py --workdir W [--configfile F] [--repeats 3]

W is a built workflow directory (its results/extract/manifest.json, results/vocab and
results/demo/verifier or the config's verifier); the train settings are its config's, with
``--set key=value`` over them (e.g. --set epochs=1). The layouts alternate, so load from other
processes falls on both alike; each layout's best run is the headline, the median beside it.
Every process runs one thread (OMP_NUM_THREADS and the like): both layouts then run two
single-threaded processes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.workflow_run import settings  # noqa: E402
from workflow_scripts.lib.workflow.config import layered_files  # noqa: E402
from workflow_scripts.lib.training.processes import THREAD_VARIABLES  # noqa: E402
from workflow_scripts.lib.workflow import cli  # noqa: E402
from workflow_scripts.lib.workflow.config import layered, load_config  # noqa: E402
from workflow_scripts.lib.workflow.layout import METRICS, Layout  # noqa: E402

WARMUP_STEPS = 3  # left out of tokens/s: the first steps also build caches


def stage_args(work: Path, config: dict, train: dict, out: Path) -> list[str]:
    cfg = load_config(layered(config, {"train": train}))
    results = work / cfg.results_dir
    verifier = Path(cfg.verifier) if cfg.verifier else results / "demo" / "verifier"
    files = dict(
        manifest=Layout(results).extract.manifest,
        engine_cmd="",
        vocab_map=Layout(results).vocab.vocab_map,
        verifier=verifier,
        state_dir=out / "state",
        draft=out / "draft",
        metrics=out / METRICS,
    )
    return shlex.split(cli.render("train", cfg.train, files))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(layout: str, work: Path, config: dict, train: dict, out: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), **{name: "1" for name in THREAD_VARIABLES}}
    module = ["-m", "workflow_scripts.stages.train"]
    if layout == "1 node x 2":
        args = stage_args(work, config, {**train, "num_nodes": 1, "num_cpu_processes": 2}, out)
        cmds = [[sys.executable, *module, *args]]
    else:
        args = stage_args(work, config, {**train, "num_nodes": 2, "num_cpu_processes": 1}, out)
        port = free_port()
        cmds = [
            [
                sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={r}",
                "--nproc-per-node=1", "--master-addr=127.0.0.1", f"--master-port={port}",
                *module, *args,
            ]  # fmt: skip
            for r in range(2)
        ]
    out.mkdir(parents=True, exist_ok=True)
    logs = [open(out / f"log{i}.txt", "w") for i in range(len(cmds))]
    procs = [
        subprocess.Popen(c, cwd=ROOT, env=env, stdout=log, stderr=log) for c, log in zip(cmds, logs)
    ]
    if any(p.wait() != 0 for p in procs):
        text = "".join((out / f"log{i}.txt").read_text()[-2000:] for i in range(len(cmds)))
        raise SystemExit(f"{layout} failed:\n{text}")
    rows = [json.loads(line) for line in (out / METRICS).read_text().splitlines()]
    steps = [r for r in rows if r.get("split") == "train" and "tokens" in r]
    timed = steps[WARMUP_STEPS:]
    seconds = timed[-1]["elapsed_s"] - steps[WARMUP_STEPS - 1]["elapsed_s"]
    draft = (out / "draft" / "model.safetensors").read_bytes()
    return {
        "tokens_per_s": sum(r["tokens"] for r in timed) / seconds,
        "steps": len(steps),
        "draft": hashlib.sha256(draft).hexdigest(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", type=Path, required=True)
    ap.add_argument("--configfile", type=Path, action="append", default=[])
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    config = layered_files(
        [a.workdir / "config.yaml", *(a.workdir / path for path in a.configfile)]
    )
    train = settings(a.set)
    layouts = ("1 node x 2", "2 nodes x 1")
    results: dict[str, list[dict]] = {layout: [] for layout in layouts}
    with tempfile.TemporaryDirectory(prefix="bench_nodes_") as tmp:
        for i in range(a.repeats):
            for layout in layouts if i % 2 == 0 else layouts[::-1]:
                out = Path(tmp) / f"{layout.replace(' ', '_')}_{i}"
                results[layout].append(run(layout, a.workdir, config, train, out))
                r = results[layout][-1]
                print(f"  {layout}, run {i + 1}: {r['tokens_per_s']:,.0f} tokens/s", flush=True)
    best = {k: max(r["tokens_per_s"] for r in v) for k, v in results.items()}
    median = {k: statistics.median(r["tokens_per_s"] for r in v) for k, v in results.items()}
    drafts = {r["draft"] for v in results.values() for r in v}
    steps = results[layouts[0]][0]["steps"]
    print(f"\n{steps} steps a run, {a.repeats} run(s) a layout, one thread a process")
    for layout in layouts:
        print(f"  {layout:12} best {best[layout]:9,.0f} tokens/s   median {median[layout]:9,.0f}")
    ratio, ratio_median = (
        best[layouts[1]] / best[layouts[0]],
        median[layouts[1]] / median[layouts[0]],
    )
    print(f"  2 nodes x 1 / 1 node x 2: {ratio:.2f} (best), {ratio_median:.2f} (median)")
    print(f"  drafts: {'all the same bytes' if len(drafts) == 1 else f'{len(drafts)} different'}")


if __name__ == "__main__":
    main()
