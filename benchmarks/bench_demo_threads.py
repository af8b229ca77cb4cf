"""How fast the demo verifier trains under each OpenMP wait policy, alone and on shared cores.

Trains the embedded default's verifier (config.yaml's demo settings) for --steps steps in fresh
processes, with as many threads as this process may use, and prints steps per second:
- alone, with OpenMP's default wait policy (threads spin a while at a barrier, then sleep:
  what the demo stage uses) and with OMP_WAIT_POLICY=PASSIVE (threads sleep at once);
- two such trainings at once on the same cores (a CPU shared with another job), per policy.
Each figure is also given as a ratio to the default policy alone, measured in the same run.
Every run must end at the same loss: the wait policy changes timing, never the arithmetic.

    .venv/bin/python benchmarks/bench_demo_threads.py [--steps 150]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

TRAIN = r"""
import itertools, json, os, sys, time
sys.path.insert(0, sys.argv[1])
import torch
from workflow_scripts.lib.demo import verifier as demo_verifier
from workflow_scripts.lib.workflow.definitions import DemoParams
from workflow_scripts.lib.demo.conversations import generate_conversations, iter_conversations
from workflow_scripts.lib.demo.formats import FORMATS

torch.set_num_threads(len(os.sched_getaffinity(0)))
p = DemoParams(train_steps=int(sys.argv[2]))
rows = generate_conversations(p.seed, p.num_conversations)
tokenizer = demo_verifier.build_tokenizer(rows, p.tokenizer_vocab_size, FORMATS[p.corpus])
start = time.perf_counter()
_, report = demo_verifier.train_verifier(p, tokenizer, iter_conversations(p.seed))
elapsed = time.perf_counter() - start
print(json.dumps({"steps_per_s": p.train_steps / elapsed, "loss": report["final_loss"]}))
"""


def launch(policy: str | None, steps: int) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    if policy:
        env["OMP_WAIT_POLICY"] = policy
    return subprocess.Popen(
        [sys.executable, "-c", TRAIN, str(ROOT), str(steps)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )


def result(proc: subprocess.Popen) -> dict:
    out, _ = proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(f"a training run failed (exit code {proc.returncode})")
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=150, help="verifier training steps per run")
    args = ap.parse_args()
    threads = len(os.sched_getaffinity(0))
    print(f"demo verifier, {args.steps} steps per run, {threads} threads per run")
    rows = []
    for label, policy in (("default (spin, then sleep)", None), ("PASSIVE", "PASSIVE")):
        alone = result(launch(policy, args.steps))
        pair = [launch(policy, args.steps) for _ in range(2)]
        shared = [result(proc) for proc in pair]
        rows.append((label, alone, shared))
    base = rows[0][1]["steps_per_s"]
    losses = {r["loss"] for _, alone, shared in rows for r in (alone, *shared)}
    print(f"{'policy':<28} {'alone':>14} {'two at once, each':>22}")
    for label, alone, shared in rows:
        each = sum(r["steps_per_s"] for r in shared) / len(shared)
        print(
            f"{label:<28} {alone['steps_per_s']:6.2f} ({alone['steps_per_s'] / base:4.2f}x)"
            f" {each:13.2f} ({each / base:4.2f}x)"
        )
    print(
        f"final loss of every run: {sorted(losses)} ({'the same' if len(losses) == 1 else 'DIFFERENT'})"
    )
    if len(losses) != 1:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
