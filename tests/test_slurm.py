"""Cluster execution against a real SLURM: two nodes with 8 fake GPUs each, both on this machine.

tests/slurm/start_slurm.sh installs SLURM when it is missing (apt-get), writes /etc/slurm from the
templates in tests/slurm/, and starts slurmctld and one slurmd per node (two slurmd on one host,
each its own node to SLURM: the closest real arrangement of several nodes one machine can hold;
srun, the node ids and the job's node list are SLURM's own, only the network is one loopback);
the daemons are stopped by pid when the session ends. Needs root: skipped for a non-root user
outside CI, an error in CI.

The workflow runs through `snakemake --profile P draft_ckpt`, P being profiles/slurm with
tests/slurm/profile-overrides.yaml merged over it (Snakemake's own command line, its SLURM
plugin checking the jobs' status every 2 s and submitting them without its 5-s pause:
tests/slurm/poll_often.py), on a copy of the session's mechanics build (conftest.py) with
extraction split over two jobs of new shards: the GPU rules (extraction, training) and CPU
rules (the vocab map, forced, and the merge) each run as SLURM jobs. The checks read SLURM's own
records (`scontrol show job`, polled while the run goes on, since a finished job no longer shows
its GPU indices) and hold them against what each job logged.

The cluster is started once per session and stopped when the session ends: while it runs,
`scontrol` answers at once (Snakemake's SLURM plugin asks it for its settings whenever Snakemake
starts, and waits 10 s for a controller that has stopped).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import datetime
from pathlib import Path

import pytest
import yaml

from tests import multinode, workflow_runner
from workflow_scripts.lib.common import sha256_file
from workflow_scripts.lib.hidden_states.records import ExtractPart
from workflow_scripts.lib.workflow.layout import Layout

pytestmark = pytest.mark.workflow

ROOT = Path(__file__).resolve().parents[1]
SLURM_DIR = ROOT / "tests" / "slurm"
RUN_TIMEOUT_S = 30 * 60  # a hard stop; the run takes about 2 minutes on 2 cores

# Over the mechanics build's config: extraction as two jobs, into shards of another size (new
# shards, computed), hence a new manifest and training; the vocab map is forced (a CPU rule).
# The point is where and how each job runs, not the quality of the verifier or the draft.
CHANGES = {"extract": {"num_jobs": 2, "use_gpus": False, "shard_size_samples": 64}}
FORCED = ["vocab"]
RULES_RUN = {"vocab": 1, "extract": 2, "extract_merge": 1, "train": 1}
# GPU jobs and the GPUs that tests/slurm/profile-overrides.yaml asks SLURM for
GPU_RULES = {"extract": 4, "train": 8}
HOST = socket.gethostname().split(".")[0]  # the first node's name; the second's is HOST-1


def _needs_root():
    if os.geteuid() == 0:
        return
    if os.environ.get("CI"):
        pytest.fail("the SLURM tests need root (apt-get, mknod, /etc/slurm) and run in CI")
    pytest.skip("the SLURM tests need root (they install and start a SLURM cluster)")


@pytest.fixture(scope="session")
def slurm_cluster():
    _needs_root()
    proc = subprocess.run(
        ["bash", str(SLURM_DIR / "start_slurm.sh")], capture_output=True, text=True, timeout=900
    )
    if proc.returncode != 0:
        pytest.fail(f"start_slurm.sh failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    pids = re.findall(r"^(slurmctld|slurmd)_pid=(\d+)$", proc.stdout, flags=re.M)
    assert sorted(name for name, _ in pids) == ["slurmctld", "slurmd", "slurmd"], proc.stdout
    submitted: list[str] = []  # job ids our tests submitted, cancelled before the daemons stop
    try:
        yield submitted
    finally:
        if submitted:
            subprocess.run(["scancel", *submitted], capture_output=True, timeout=60)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and _active(submitted):
                time.sleep(1)
        for _, pid in sorted(pids, key=lambda p: p[0] == "slurmctld"):  # the nodes first
            _stop(int(pid))


def _active(job_ids: list[str]) -> bool:
    out = subprocess.run(
        ["squeue", "-h", "-o", "%i %T", "-j", ",".join(job_ids)],
        capture_output=True,
        text=True,
    ).stdout
    return any(s in out for s in ("RUNNING", "PENDING", "COMPLETING", "CONFIGURING"))


def _alive(pid: int) -> bool:
    """Running, and not a zombie that nobody has reaped yet."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def _stop(pid: int) -> None:
    if not _alive(pid):
        return
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if not _alive(pid):
            return
        time.sleep(0.2)
    os.kill(pid, signal.SIGKILL)


# ----------------------------------------------------------------- SLURM's records


def parse_jobs(text: str) -> dict[str, dict[str, str]]:
    """`scontrol show job -d -o` -> {job id: {field: value}} (values without spaces suffice)."""
    jobs = {}
    for line in text.splitlines():
        fields = dict(re.findall(r"(?:^|\s)([A-Za-z_/:]+)=(\S*)", line))
        if "JobId" in fields:
            jobs[fields["JobId"]] = fields
    return jobs


def expand_idx(gres: str) -> list[int]:
    """'gpu:4(IDX:0-1,4-5)' -> [0, 1, 4, 5]."""
    m = re.search(r"IDX:([\d,-]+)\)", gres)
    if not m:
        return []
    ids = []
    for part in m.group(1).split(","):
        lo, _, hi = part.partition("-")
        ids += range(int(lo), int(hi or lo) + 1)
    return ids


class JobPoller(threading.Thread):
    """Reads `scontrol show job -d -o` every second: a running job's GPU indices (GRES=...IDX)
    are only shown while it runs."""

    def __init__(self):
        super().__init__(daemon=True)
        self.stop_event = threading.Event()
        self.running_idx: dict[str, list[int]] = {}

    def run(self):
        while not self.stop_event.is_set():
            out = subprocess.run(
                ["scontrol", "show", "job", "-d", "-o"], capture_output=True, text=True
            ).stdout
            for job_id, rec in parse_jobs(out).items():
                if rec.get("JobState") == "RUNNING" and expand_idx(rec.get("GRES", "")):
                    self.running_idx[job_id] = expand_idx(rec["GRES"])
            self.stop_event.wait(1.0)


def all_jobs() -> dict[str, dict[str, str]]:
    out = subprocess.run(
        ["scontrol", "show", "job", "-d", "-o"], capture_output=True, text=True, check=True
    ).stdout
    return parse_jobs(out)


def rule_of(rec: dict[str, str]) -> str:
    """The plugin names each job's rule in its comment: rule_<name>[_wildcards_<values>]."""
    return re.sub(r"_wildcards_.*$", "", rec["Comment"]).removeprefix("rule_")


def merged_profile(dst: Path) -> Path:
    """profiles/slurm/config.yaml with the test cluster's settings merged over it."""
    profile = yaml.safe_load((ROOT / "profiles" / "slurm" / "config.yaml").read_text())
    overrides = yaml.safe_load((SLURM_DIR / "profile-overrides.yaml").read_text())
    for key, value in overrides.items():
        if key == "set-resources":
            rules = profile.setdefault(key, {})
            for rule, res in value.items():
                rules[rule] = {**rules.get(rule, {}), **res}
        elif key == "default-resources":
            profile[key] = {**profile.get(key, {}), **value}
        else:
            profile[key] = value
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.yaml").write_text(yaml.safe_dump(profile, sort_keys=False))
    return dst


# ----------------------------------------------------------------- tests


def test_gpu_launcher_inside_slurm_jobs(slurm_cluster, tmp_path):
    """Under SLURM the launcher passes on the job's own GPUs, and refuses a job given too few."""
    env = workflow_runner.env()
    env["EAGLE3_GPU_LOCK_DIR"] = str(tmp_path / "locks")
    launcher = f"{sys.executable} -m workflow_scripts.lib.workflow.gpus"
    jobs = {
        "a": ("--gpus=4", f"{launcher} 4 -- sh -c 'echo visible=$CUDA_VISIBLE_DEVICES; sleep 4'"),
        "b": ("--gpus=4", f"{launcher} 4 -- sh -c 'echo visible=$CUDA_VISIBLE_DEVICES; sleep 4'"),
        "few": ("--gpus=2", f"{launcher} 4 -- sh -c 'echo ran'"),
    }
    ids = {}
    for name, (gpus, cmd) in jobs.items():
        out = subprocess.run(
            [
                "sbatch",
                "--parsable",
                gpus,
                "--nodes=1",
                f"--nodelist={HOST}",  # a and b side by side on one node's 8 GPUs
                "--cpus-per-gpu=1",
                "--mem=500",
                f"--output={tmp_path / name}.log",
                f"--chdir={ROOT}",
                f"--wrap={cmd}",
            ],
            capture_output=True,
            text=True,
            env=env,
            check=True,
        ).stdout
        ids[name] = out.strip().split(";")[0]
        slurm_cluster.append(ids[name])
    deadline = time.monotonic() + 120
    while _active(list(ids.values())):
        assert time.monotonic() < deadline, "the SLURM jobs did not finish in 2 minutes"
        time.sleep(1)
    recs = all_jobs()
    logs = {name: (tmp_path / f"{name}.log").read_text() for name in jobs}
    seen = {}
    for name in ("a", "b"):
        assert recs[ids[name]]["JobState"] == "COMPLETED", logs[name]
        seen[name] = re.search(r"^visible=(\S+)$", logs[name], flags=re.M).group(1).split(",")
        assert len(seen[name]) == 4
        assert f"gpus: SLURM job {ids[name]} " in logs[name]
    assert not set(seen["a"]) & set(seen["b"]), seen  # both ran at once on the 8 GPUs
    assert recs[ids["few"]]["JobState"] == "FAILED"
    assert "needs 4 GPU(s), found 2" in logs["few"] and "ran" not in logs["few"].split("\n")


@pytest.mark.engine
def test_workflow_on_slurm_runs_each_gpu_rule_as_its_own_job(
    slurm_cluster, mechanics_build, tmp_path
):
    built, config = mechanics_build
    workdir = tmp_path / "wf"
    shutil.copytree(built, workdir, symlinks=True)
    changed = {**config, **{k: {**config.get(k, {}), **v} for k, v in CHANGES.items()}}
    workflow_runner.write_config(workdir, changed)
    profile = merged_profile(tmp_path / "profile")
    poller = JobPoller()
    poller.start()
    log_path = tmp_path / "snakemake.log"
    started = time.monotonic()
    try:
        proc = _snakemake(workdir, profile, log_path, "--forcerun", *FORCED)
        returncode = _finish(proc, workdir, slurm_cluster)  # what still runs is cancelled
    finally:
        poller.stop_event.set()
        poller.join()
    elapsed = time.monotonic() - started
    text = log_path.read_text()
    assert returncode == 0, f"snakemake failed ({returncode}) after {elapsed:.0f}s:\n" + (
        text[-12000:] + _failed_job_logs(workdir)
    )
    print(f"workflow on SLURM: {elapsed:.0f}s")
    assert any((workdir / "results" / "train" / "draft").iterdir())

    # every job of the run, from SLURM's records (MinJobAge keeps finished jobs for an hour)
    recs = {j: r for j, r in all_jobs().items() if r.get("WorkDir") == str(workdir)}
    by_rule: dict[str, list[str]] = {}
    for job_id, rec in sorted(recs.items(), key=lambda kv: int(kv[0])):
        assert rec["JobState"] == "COMPLETED" and rec["ExitCode"] == "0:0", rec
        by_rule.setdefault(rule_of(rec), []).append(job_id)
    for rule, ids in by_rule.items():
        for job_id in ids:
            rec = recs[job_id]
            print(f"  {rule:14} SLURM job {job_id:>4} {rec['StartTime']} .. {rec['EndTime']}")
    # each rule's job ran as a SLURM job of its own; extraction as two
    assert {rule: len(ids) for rule, ids in by_rule.items()} == RULES_RUN, by_rule
    for job in range(2):  # new shards: each extraction job loaded the model and computed some
        text = (workdir / "results" / "logs" / "extract" / f"job_{job}.log").read_text()
        assert "nothing to compute" not in text and "0 finished already" in text, text[-3000:]
        assert "samples/s" in text and "tokens/s" in text and "ETA" in text
    # the jobs took every other shard, and together wrote what the build's one job did
    extracted = Layout(workdir / "results").extract
    parts = [ExtractPart.read(extracted.part(job)) for job in range(2)]
    count = sum(len(part.shards) for part in parts)
    for job, part in enumerate(parts):
        assert [e.index for e in part.shards] == list(range(job, count, 2))
    ours, one_job = _states(extracted.shards), _states(built / "results" / "extract" / "shards")
    for key in CONCATENATED:
        assert (ours[key].double() - one_job[key].double()).abs().max().item() <= 1e-5, key

    # what each job logged about its devices
    logged = _launcher_lines(workdir / "results" / "logs")
    for rule, count in GPU_RULES.items():
        for job_id in by_rule[rule]:
            rec = recs[job_id]
            # the GPUs it asked for, on one node, as one task (not one task per GPU)
            assert rec["TresPerJob"] == f"gres:gpu:{count}", rec
            assert rec["NumNodes"] == "1" and rec["NumTasks"] == "1", rec
            # the devices SLURM allocated while it ran, and what the job was given
            assert job_id in poller.running_idx, (job_id, poller.running_idx)
            allocated = poller.running_idx[job_id]
            assert len(allocated) == count
            assert job_id in logged, (job_id, logged)
            assert logged[job_id] == [str(i) for i in allocated], (rule, job_id, logged)
    for rule, ids in by_rule.items():
        if rule not in GPU_RULES:
            for job_id in ids:
                assert "gpu" not in recs[job_id].get("TresPerJob", ""), recs[job_id]
                assert job_id not in poller.running_idx and job_id not in logged

    # the two extraction jobs, when side by side on one node (4 + 4 GPUs): on different GPUs
    a, b = (recs[j] for j in by_rule["extract"])
    if _overlap(a, b) and a["NodeList"] == b["NodeList"]:
        ia, ib = (set(poller.running_idx[j]) for j in by_rule["extract"])
        assert not ia & ib, (ia, ib)


def _overlap(a: dict[str, str], b: dict[str, str]) -> bool:
    t = lambda s: datetime.fromisoformat(s)  # noqa: E731
    return t(a["StartTime"]) < t(b["EndTime"]) and t(b["StartTime"]) < t(a["EndTime"])


def _launcher_lines(log_dir: Path) -> dict[str, list[str]]:
    """SLURM job id -> CUDA_VISIBLE_DEVICES, from the line workflow_scripts/lib/workflow/gpus.py
    writes first into a GPU rule's log."""
    found = {}
    pattern = re.compile(r"^gpus: SLURM job (\d+) on \S+: CUDA_VISIBLE_DEVICES=(\S+)", re.M)
    for path in log_dir.rglob("*.log"):
        for job_id, visible in pattern.findall(path.read_text(errors="replace")):
            found[job_id] = visible.rstrip(";").split(",")
    return found


def _failed_job_logs(workdir: Path) -> str:
    parts = []
    logs = (("results/logs/**/*.log", 3000), (".snakemake/slurm_logs/**/*.log", 2000))
    for pattern, tail in logs:
        for path in sorted(workdir.glob(pattern)):
            text = path.read_text(errors="replace")[-tail:]
            parts.append(f"\n--- {path.relative_to(workdir)}\n{text}")
    return "".join(parts)[-20000:]


# ----------------------------------------------------------------- training over two nodes

# The profile for training over nodes: the test cluster's, with rule train on the CPU (no fake
# GPUs: the rule reserves nodes, tasks and srun itself), one CPU and one thread a task (Snakemake
# sets OMP_NUM_THREADS to a job's threads: one, as tests/multinode.py trains)
TRAIN_ON_CPU = {"tasks_per_gpu": 0, "cpus_per_task": 1, "mem_mb": 2000, "runtime": 30}


def _node_processes(node: str) -> list[int]:
    """Our processes on SLURM node ``node`` (by the SLURMD_NODENAME srun gives each task)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            environ = (proc / "environ").read_bytes().split(b"\0")
            cmdline = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if f"SLURMD_NODENAME={node}".encode() in environ and b"workflow_scripts" in cmdline:
            found.append(int(proc.name))
    return found


def _snakemake(
    workdir: Path, profile: Path, log_path: Path, *args: str, target: str = "draft_ckpt"
) -> subprocess.Popen:
    """`snakemake TARGET --profile P` in ``workdir``, in a session of its own, writing to
    ``log_path`` (through tests/slurm/poll_often.py: the jobs' status checked every 2 s, no
    pause before each submission)."""
    cmd = [
        sys.executable, str(SLURM_DIR / "poll_often.py"), target, "--profile", str(profile),
        "--configfile", "test_config.yaml", *args,
    ]  # fmt: skip
    log = open(log_path, "w")
    return subprocess.Popen(
        cmd,
        cwd=workdir,
        env=workflow_runner.env(),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def _lose_second_node(
    proc, ready, what: str, workdir: Path, slurm_cluster, log: Path, wait_s: float
) -> str:
    """Once ``ready()`` (within ``wait_s``), every process of ours on the second node killed
    (kill -9): the run fails, its job one over both nodes (SLURM's record); returns the rule's
    log."""
    deadline = time.monotonic() + wait_s
    while not ready():
        assert proc.poll() is None and time.monotonic() < deadline, _failed_job_logs(workdir)
        time.sleep(0.2)
    killed = _node_processes(f"{HOST}-1")
    assert killed, f"no {what} process found on the second node"
    for pid in killed:
        os.kill(pid, signal.SIGKILL)
    assert _finish(proc, workdir, slurm_cluster) != 0
    text = log.read_text()
    job = re.search(r"^nodes: SLURM job (\d+): 2 nodes", text, flags=re.M).group(1)
    rec = all_jobs()[job]
    assert rec["NumNodes"] == "2" and rec["NumTasks"] == "2", rec
    return text


def _finish(proc: subprocess.Popen, workdir: Path, slurm_cluster: list[str]) -> int:
    """Its exit status, killed after RUN_TIMEOUT_S; the SLURM jobs of ``workdir`` are handed to
    the cluster fixture, which cancels any still running."""
    try:
        return proc.wait(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return proc.wait()
    finally:
        ours = [j for j, r in all_jobs().items() if r.get("WorkDir") == str(workdir)]
        slurm_cluster.extend(ours)


@pytest.mark.workflow
def test_training_over_two_nodes_is_the_one_node_draft_and_resumes_after_a_node_is_lost(
    slurm_cluster, mechanics_build, one_node_draft, tmp_path
):
    """`snakemake --profile ... draft_ckpt` with train.num_nodes 2 (one process a node): one
    SLURM job over both nodes, the nodes launcher's srun starting the stage on each, each node's
    torchrun meeting at node 0 (static rendezvous). Node 1's processes are killed (kill -9)
    after the first checkpoint: the job fails, naming the cause. The same command resumes from
    the checkpoint, again on two nodes, and ends at the draft that one node of two processes
    trains uninterrupted (conftest.py one_node_draft; tests/test_train_nodes.py shows two
    nodes uninterrupted give it too): the same bytes, gloo's all-reduce of two ranks being the
    same sum. The dry-run refuses what the cluster or profile cannot give."""
    built, _ = mechanics_build
    workdir = tmp_path / "wf"
    shutil.copytree(built, workdir, symlinks=True)
    config = multinode.config_with(built, num_nodes=2, num_cpu_processes=1)
    workflow_runner.write_config(workdir, config)
    profile = merged_profile(tmp_path / "profile")
    settings = yaml.safe_load((profile / "config.yaml").read_text())
    settings["set-resources"]["train"] = TRAIN_ON_CPU
    settings["set-threads"] = {"train": 1}
    settings["retries"] = 0  # the profile's retries would resubmit the job: this is the rerun
    (profile / "config.yaml").write_text(yaml.safe_dump(settings, sort_keys=False))
    draft = workdir / "results" / "train" / "draft" / "model.safetensors"
    train_log = workdir / "results" / "logs" / "train.log"

    # at dry-run: more nodes than SLURM has, and a profile that gives the job one node
    for changed, set_resources, why in (
        (multinode.config_with(built, num_nodes=3), None, "num_nodes is 3, but SLURM has 2 node"),
        (config, {"train": {"nodes": 1}}, "the profile sets nodes: 1 for rule train"),
    ):
        error, out = workflow_runner.dry_run_in_process(
            workdir, "draft_ckpt", changed, set_resources, slurm=True
        )
        assert error is not None and why in error and "train.num_nodes" in error, out[-3000:]

    # one job of two nodes; node 1 lost after the first checkpoint: the job fails, saying so
    shutil.rmtree(workdir / "results" / "train" / "state")
    state = workdir / "results" / "train" / "state" / "state.pt"
    proc = _snakemake(workdir, profile, tmp_path / "killed.log")
    text = _lose_second_node(
        proc, state.exists, "training", workdir, slurm_cluster, train_log, wait_s=600
    )
    job = re.search(r"^nodes: SLURM job (\d+): 2 nodes", text, flags=re.M).group(1)
    port = 20000 + int(job) % 20000
    for rank, node in enumerate((HOST, f"{HOST}-1")):
        assert f"node {rank} of 2 (SLURM job {job}, node {node}): starting 1 training" in text
        assert f"--nnodes=2 --node-rank={rank} --master-addr=127.0.0.1 --master-port={port}" in text
    assert "over 2 process(es) on cpu" in text and "every process sees the same inputs" in text
    assert "nodes: error: the command stopped on at least one of the 2 nodes" in text, text[-3000:]
    assert "resumes from its last checkpoint" in text
    time.sleep(2)
    assert not _node_processes(HOST) and not _node_processes(f"{HOST}-1")  # none left behind

    # the same command again: resumed from the checkpoint, the same draft
    proc = _snakemake(workdir, profile, tmp_path / "resumed.log")
    assert _finish(proc, workdir, slurm_cluster) == 0, _failed_job_logs(workdir)
    text = train_log.read_text()
    assert re.search(r"resumed from \S+state.pt at step (20|40) of 50", text), text[-3000:]
    assert sha256_file(draft) == one_node_draft


# ----------------------------------------------------------------- the verifier over two nodes

# Extraction with the verifier's engine over both nodes (tensor parallel 2, one CPU worker a
# node), into shards of 4 samples (many, so that a node is lost with most of them to compute)
ENGINE_NODES = {"num_nodes": 2, "tensor_parallel_size": 2, "use_gpus": False}
ENGINE_ON_CPU = {"tasks_per_gpu": 0, "cpus_per_task": 1, "mem_mb": 6000, "runtime": 30}
CONCATENATED = ("input_ids", "loss_mask", "aux_hidden_states", "final_hidden_states")


def _states(shard_dir: Path) -> dict:
    """Every shard's tensors, concatenated in shard order (the same samples, however cut)."""
    import torch
    from safetensors.torch import load_file

    shards = [load_file(p) for p in sorted(shard_dir.glob("shard_*.safetensors"))]
    return {k: torch.cat([s[k] for s in shards]) for k in CONCATENATED}


@pytest.mark.workflow
def test_extraction_with_the_verifier_over_two_nodes_gives_one_nodes_states_and_resumes(
    slurm_cluster, mechanics_build, tmp_path
):
    """`snakemake --profile ... hidden_states` with extract.num_nodes 2: one SLURM job over both
    nodes, the stage on the first and the engine's follower on the second (srun), vLLM's engine
    across them (tensor parallel 2, ranks meeting over TCP as on two machines). The second
    node's processes are killed once some shards are done: the job fails, naming the node. The
    same command resumes, computing only the shards not finished, and the states equal those
    the build's one-node engine extracted (to float32 round-off: tensor parallelism sums in
    another order), token ids and loss masks exactly."""
    built, _ = mechanics_build
    workdir = tmp_path / "wf"
    shutil.copytree(built, workdir, symlinks=True)
    config = yaml.safe_load((built / "test_config.yaml").read_text()) or {}
    config["extract"] = {**config.get("extract", {}), **ENGINE_NODES, "shard_size_samples": 4}
    workflow_runner.write_config(workdir, config)
    profile = merged_profile(tmp_path / "profile")
    settings = yaml.safe_load((profile / "config.yaml").read_text())
    settings["set-resources"]["extract"] = ENGINE_ON_CPU
    settings["retries"] = 0  # the profile's retries would resubmit the job: this is the rerun
    (profile / "config.yaml").write_text(yaml.safe_dump(settings, sort_keys=False))
    shards = workdir / "results" / "extract" / "shards"
    shutil.rmtree(shards)
    log = workdir / "results" / "logs" / "extract" / "job_0.log"

    def run(name: str) -> subprocess.Popen:
        return _snakemake(workdir, profile, tmp_path / f"{name}.log", target="hidden_states")

    # the second node lost once two shards are done: the job fails, naming it
    proc = run("killed")
    two_done = lambda: len(list(shards.glob("shard_*.sha256.json"))) >= 2  # noqa: E731
    text = _lose_second_node(proc, two_done, "engine", workdir, slurm_cluster, log, wait_s=900)
    assert f"the stage on {HOST}, its followers started by srun --nodes=1" in text
    assert f"node 1 ({HOST}-1) of 2: starting its workers" in text
    # which side sees the loss first is a race: the launcher (srun's step ended while the stage
    # ran) or the stage (its engine dead once a worker's connection dropped), and then srun's
    # own line, after the stage's, names the node
    workers = f"error: the engine's workers on {HOST}-1 stopped while the stage ran" in text
    stage = re.search(rf"srun: error: {HOST}-1: task \d+: Killed", text) and re.search(
        rf"nodes: error: the stage failed on {HOST} \(exit status [1-9]", text
    )
    assert workers or stage, text[-3000:]
    done = len(list(shards.glob("shard_*.sha256.json")))
    time.sleep(2)
    assert not _node_processes(HOST) and not _node_processes(f"{HOST}-1")  # none left behind

    # the same command again: only the shards not finished, then the one-node states
    proc = run("resumed")
    assert _finish(proc, workdir, slurm_cluster) == 0, _failed_job_logs(workdir)
    text = log.read_text()
    found = re.search(r"(\d+) finished already, (\d+) to compute", text)
    assert found and int(found[1]) >= done and int(found[1]) + int(found[2]) > done, text[-3000:]
    ours, one_node = _states(shards), _states(built / "results" / "extract" / "shards")
    for key in ("input_ids", "loss_mask"):
        assert ours[key].equal(one_node[key]), key
    for key in ("aux_hidden_states", "final_hidden_states"):
        scale = one_node[key].abs().max()
        assert ((ours[key] - one_node[key]).abs().max() / scale).item() < 1e-5, key
