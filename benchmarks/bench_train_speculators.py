"""Training throughput of this workflow's trainer against speculators 0.9.0's EAGLE-3 trainer
(`python -m speculators.train`, its own script and default recipe) on the same samples of a
built manifest, side by side in one run. Prints tokens/s of every run, the best and median of
each trainer and the ratio ours / theirs (target >= 0.8).

    .venv/bin/python benchmarks/bench_train_speculators.py                    # results/'s build
    .venv/bin/python benchmarks/bench_train_speculators.py --results bench_real/results-real
    .venv/bin/python benchmarks/bench_train_speculators.py --manifest M --vocab-map V \\
        --verifier DIR --steps 12 --rounds 4 --json out.json

speculators needs transformers 5 and its own torch, so it runs from a venv of its own (--venv;
made on the first run: torch 2.13.0 from the local wheels, speculators and hs-connectors 0.9.0
without their unused torchvision/torchaudio, and the packages they import). The first samples
of the manifest (enough for --steps of both, or --samples) are copied into one shard of ours
and converted, inside that venv, to speculators' layout: a `datasets` folder (input_ids,
loss_mask, seq_len), hidden_states/hs_<row>.safetensors ([T, 4, H]: the auxiliary layers
ascending, then the final state before the norm), d2t/t2d .npy, and a verifier of only
config.json, the embedding, final norm and lm_head. speculators has no CPU path: it runs under
a launcher here that puts its trainer on the CPU and makes torch.accelerator.synchronize a
no-op (runtime patches only), with eager loss, SDPA draft attention and no loader workers.

Ours trains the recipe of config.yaml (then each --configfile over it: the build's), theirs its own
defaults; both a 1-layer draft with 3 TTT steps, the same draft vocabulary and --threads compute
threads; ours takes --micro-batch-budget-tokens a step (padding included), theirs one packed
sequence of --total-seq-len real tokens (default: ours' mean real tokens a step). Each round is a
fresh run of each, ours first in odd rounds and theirs first in even ones, so that load from other
processes falls on both alike; each run's first --warmup steps are not counted. Tokens are counted
as speculators counts them (a sample of n tokens trains n - 1 positions), over each step's wall
time, its data read included.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_train import scratch_io  # noqa: E402
from tests import factories  # noqa: E402
from workflow_scripts.lib.hidden_states import manifest as manifests  # noqa: E402
from workflow_scripts.lib.hidden_states.shard_writer import write_samples  # noqa: E402
from workflow_scripts.lib.hidden_states.shards import DTYPE_NAMES, ShardReader  # noqa: E402
from workflow_scripts.lib.training.inputs import check_inputs  # noqa: E402
from workflow_scripts.lib.training.loader import Loader  # noqa: E402
from workflow_scripts.lib.training.processes import setup_processes  # noqa: E402
from workflow_scripts.lib.training.trainer import Trainer  # noqa: E402
from workflow_scripts.lib.workflow.config import ConfigError, load_config_files  # noqa: E402
from workflow_scripts.lib.workflow.definitions import TrainParams  # noqa: E402
from workflow_scripts.lib.workflow.layout import MANIFEST, Layout  # noqa: E402

SPECULATORS = ["speculators==0.9.0", "hs-connectors==0.9.0"]
# speculators 0.9.0's declared requirements less torchvision and torchaudio (never imported),
# plus pyyaml and packaging (imported, not declared)
SPECULATORS_DEPS = [
    "transformers>=5.0.0,<=5.19.0", "datasets>=4.0.0,<=5.1.0", "numpy>=2.0.0,<=2.5.4",
    "loguru>=0.7.2,<=0.7.3", "tqdm>=4.66.3,<=4.70.1", "openai>=2.0.0", "pydantic>=2",
    "pydantic-settings>=2", "aiohttp", "click", "httpx", "huggingface-hub", "protobuf", "psutil",
    "rich", "safetensors", "typer>=0.12", "pyyaml", "packaging",
]  # fmt: skip
TORCH = "torch==2.13.0"

# Run by the speculators venv's python: our shard -> speculators' data folder and verifier.
CONVERT = r"""
import json, shutil, sys
from pathlib import Path
import datasets, numpy as np, torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

a = json.loads(sys.argv[1])
out, verifier = Path(a["out"]), Path(a["verifier"])
(out / "hidden_states").mkdir(parents=True)
dtype = getattr(torch, a["dtype"])
rows = {"input_ids": [], "loss_mask": [], "seq_len": []}
with safe_open(a["shard"], framework="pt") as f:
    keys = set(f.keys())

    def states(name, x, y):
        v = f.get_slice(name + "_hidden_states")[x:y]
        if name + "_scales" in keys:  # float8 rows: value x the row's scale
            v = v.float() * f.get_slice(name + "_scales")[x:y].unsqueeze(-1)
        return v.to(dtype)

    off, foff = f.get_tensor("sample_offsets"), f.get_tensor("final_offsets")
    for s in range(off.numel() - 1):
        x, y = int(off[s]), int(off[s + 1])
        ids = f.get_slice("input_ids")[x:y].long()
        # ours holds the final state at j where token j+1 is supervised; speculators reads it
        # at its loss positions (after its shift), so those positions are its loss mask
        read = torch.nonzero(f.get_slice("loss_mask")[x:y][1:].bool()).flatten()
        aux = states("aux", x, y)[:, a["aux_order"]]
        final = aux.new_zeros(y - x, aux.shape[-1])
        final[read] = states("final", int(foff[s]), int(foff[s + 1]))
        mask = torch.zeros(y - x, dtype=torch.long)
        mask[read] = 1
        hs = torch.cat([aux, final[:, None]], dim=1).contiguous()
        save_file({"hidden_states": hs, "token_ids": ids.contiguous()},
                  str(out / "hidden_states" / f"hs_{s}.safetensors"))
        rows["input_ids"].append(ids.tolist())
        rows["loss_mask"].append(mask.tolist())
        rows["seq_len"].append(y - x)
ds = datasets.Dataset.from_dict(rows)
ds.set_format(type="torch")
ds.save_to_disk(str(out))
maps = load_file(a["vocab_map"])
n = int(maps["d2t"].numel())
np.save(out / f"d2t-{n}.npy", maps["d2t"].numpy().astype(np.int64))
np.save(out / f"t2d-{n}.npy", maps["t2d"].numpy().astype(bool))
index = verifier / "model.safetensors.index.json"
files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() \
    else ["model.safetensors"]
want = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
tensors = {}
for name in files:
    with safe_open(str(verifier / name), framework="pt") as w:
        tensors.update({k: w.get_tensor(k) for k in w.keys() if k in want})
if "model.embed_tokens.weight" not in tensors or "model.norm.weight" not in tensors:
    sys.exit(f"{verifier}: no model.embed_tokens.weight / model.norm.weight in its safetensors")
if "lm_head.weight" not in tensors:  # tied embeddings
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
head = out / "verifier"
head.mkdir()
shutil.copy(verifier / "config.json", head / "config.json")
save_file({k: v.contiguous() for k, v in tensors.items()}, str(head / "model.safetensors"))
print(json.dumps({"samples": len(ds), "draft_vocab_size": n, "verifier": str(head)}))
"""

# Run by the speculators venv's python: `speculators.train` on the CPU, each step's metrics
# appended to the JSON-lines file in $BENCH_METRICS.
LAUNCH = r"""
import json, logging, os, sys
import torch
import speculators.train.cli as cli
import speculators.train.trainer as trainer
from speculators.train.config import TrainConfig

trainer.get_local_rank = lambda: torch.device("cpu")  # else .to(0): no accelerator here
if not torch.accelerator.is_available():
    torch.accelerator.synchronize = lambda *args, **kwargs: None  # its step timer calls it


class Steps(logging.Handler):
    def emit(self, record):
        if isinstance(record.msg, dict) and "profile" in record.msg:
            with open(os.environ["BENCH_METRICS"], "a") as f:
                f.write(json.dumps(record.msg, default=str) + "\n")


setup = cli.setup_metric_logger


def with_steps(*args, **kwargs):
    setup(*args, **kwargs)  # it configures logging anew: add the handler after it
    logging.getLogger("speculators.metrics").addHandler(Steps())


cli.setup_metric_logger = with_steps
cli.main(TrainConfig.resolve(sys.argv[1:]))
"""


def venv_python(venv: Path) -> Path:
    """The venv's python with speculators 0.9.0 importable; the venv is made if missing."""
    python = venv / "bin" / "python"
    check = (
        "import speculators.train, hs_connectors, datasets; from importlib.metadata import "
        "version; print(version('speculators'))"
    )
    if python.is_file():
        found = subprocess.run([python, "-c", check], capture_output=True, text=True)
        if found.returncode == 0 and found.stdout.strip() == "0.9.0":
            return python
    if venv.exists() and not (venv / "pyvenv.cfg").is_file():
        raise SystemExit(f"--venv {venv} exists and is not a venv: name another path")
    print(f"making the speculators venv {venv} (a few minutes)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    pip = [python, "-m", "pip", "install", "--quiet"]
    for extra in ([TORCH], ["--no-deps", *SPECULATORS], [TORCH, *SPECULATORS_DEPS]):
        print("  pip install " + " ".join(extra), flush=True)
        if subprocess.run([*pip, *extra]).returncode != 0:
            raise SystemExit(f"pip install into {venv} failed (above); delete {venv} and rerun")
    found = subprocess.run([python, "-c", check], capture_output=True, text=True)
    if found.returncode != 0:
        raise SystemExit(f"speculators does not import in {venv}:\n{found.stderr[-2000:]}")
    listed = subprocess.run([python, "-m", "pip", "list", "--format=freeze"], capture_output=True)
    print("installed: " + ", ".join(listed.stdout.decode().split()), flush=True)
    return python


def subset(manifest_path: Path, verifier: Path, samples: int, tokens: int, out: Path):
    """The first samples of the manifest as one shard of ours with its manifest: ``samples`` of
    them, or (0) as many as hold ``tokens``. Returns the manifest, the shard and the lengths."""
    m = manifests.load_manifest(manifest_path)
    picked = []
    for entry in m.shards:
        reader = ShardReader(Path(entry.path))
        for i in range(len(reader)):
            picked.append(reader.sample(i))
            if len(picked) == samples or (
                not samples and sum(s.num_tokens for s in picked) >= tokens
            ):
                break
        else:
            continue
        break
    if samples and len(picked) < samples:
        raise SystemExit(f"{manifest_path} holds {len(picked)} samples; --samples {samples}")
    out.mkdir(parents=True)
    shard = out / manifests.shard_name(0)
    write_samples(shard, picked, {"fingerprint": "bench-speculators", "sample_start": "0"})
    storage = DTYPE_NAMES[picked[0].aux_hidden_states.dtype]  # float8 is read as float32
    subset_manifest = factories.manifest(
        [shard], out, verifier, m.aux_layer_ids, m.dtype, storage, len(picked)
    )
    subset_manifest.write(out / MANIFEST)
    return out / MANIFEST, shard, [s.num_tokens for s in picked], m.aux_layer_ids


def run_ours(io, p: TrainParams, steps: int, warmup: int) -> dict:
    """A fresh trainer's first ``steps`` steps, each timed with its data read from the shard."""
    trainer = Trainer(io, p, check_inputs(io, p), setup_processes(p))
    if trainer.plan.total_steps < steps:
        raise SystemExit(f"our plan has {trainer.plan.total_steps} steps; raise --samples")
    loader = Loader(trainer.inputs.index, trainer.plan, 0, steps, 0, 1, torch.float32, False, False)
    it, per_step = iter(loader), []
    for _ in range(steps):
        start = time.perf_counter()
        data = next(it)
        trainer.train_step(data)
        seconds = time.perf_counter() - start
        rows = sum(int(mb.input_ids.shape[0]) for mb in data.micro_batches)
        per_step.append((sum(mb.num_tokens for mb in data.micro_batches) - rows, seconds))
    return summarize(per_step[warmup:])


def run_theirs(python: Path, flags: list[str], work: Path, threads: int, warmup: int) -> dict:
    """One `speculators.train` process; its steps' tokens and times from its own profile."""
    work.mkdir(parents=True)
    metrics, log = work / "steps.jsonl", work / "train.log"
    env = {
        **os.environ, "BENCH_METRICS": str(metrics), "HF_HUB_OFFLINE": "1", "COLUMNS": "250",
        "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "PYTHONPATH": "",
    }  # fmt: skip
    env.pop("LOCAL_RANK", None)  # one process: distributed needs an accelerator
    cmd = [python, "-c", LAUNCH, *flags, "--save-path", str(work / "ckpt")]
    with log.open("w") as f:
        done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=work)
    if done.returncode != 0:
        tail = log.read_text()[-3000:]
        raise SystemExit(f"speculators.train failed (rc {done.returncode}), log {log}:\n{tail}")
    per_step, skipped = [], 0
    for line in metrics.read_text().splitlines() if metrics.is_file() else []:
        record = json.loads(line)
        prof, skipped = record["profile"], skipped + record["train"].get("error_records", 0)
        per_step.append((prof["tokens_per_s"] * prof["step_ms"] / 1000, prof["step_ms"] / 1000))
    if skipped:
        print(f"warning: speculators skipped {skipped:.0f} sample(s) as bad; log {log}")
    steps = int(flags[flags.index("--max-steps") + 1])
    if len(per_step) < steps:
        raise SystemExit(
            f"speculators logged {len(per_step)} of {steps} steps (log {log}): its epoch is "
            "shorter; raise --samples"
        )
    return summarize(per_step[warmup:steps])


def summarize(per_step: list[tuple[float, float]]) -> dict:
    tokens, seconds = sum(t for t, _ in per_step), sum(s for _, s in per_step)
    return {
        "steps": len(per_step),
        "tokens": round(tokens),
        "seconds": seconds,
        "tokens_per_step": tokens / len(per_step),
        "tokens_per_s": tokens / seconds,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--results", type=Path, default=ROOT / "results", help="a results_dir")
    parser.add_argument(
        "--configfile", type=Path, nargs="+", default=[], help="over config.yaml: ours' recipe"
    )
    parser.add_argument("--manifest", type=Path, help="default: the extract manifest of --results")
    parser.add_argument("--vocab-map", type=Path, help="default: <results>/vocab/...")
    parser.add_argument("--verifier", type=Path, help="default: <results>/demo/verifier")
    parser.add_argument(
        "--venv",
        type=Path,
        default=ROOT / "results" / "benchmarks" / "venv-speculators",
        help="speculators' venv, made if missing (default under results/, which git ignores)",
    )
    parser.add_argument("--samples", type=int, default=0, help="0: enough for --steps")
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps a run")
    parser.add_argument("--warmup", type=int, default=2, help="first steps of a run not counted")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--micro-batch-budget-tokens", type=int, default=8192)
    parser.add_argument("--total-seq-len", type=int, default=0, help="0: ours' real tokens/step")
    parser.add_argument("--hidden-states-dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--json", type=Path, help="write every figure here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.warmup >= args.steps:
        raise SystemExit("--warmup must be below --steps")
    manifest = args.manifest or Layout(args.results).extract.manifest
    vocab_map = args.vocab_map or Layout(args.results).vocab.vocab_map
    verifier = args.verifier or Layout(args.results).demo.verifier
    for what, path in (("manifest", manifest), ("vocab map", vocab_map), ("verifier", verifier)):
        if not path.exists():
            raise SystemExit(
                f"no {what} at {path}: build through train's inputs (`snakemake vocab extract`) "
                "or pass --results / --manifest, --vocab-map, --verifier"
            )
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # setup_processes then leaves threads be
    torch.set_num_threads(args.threads)
    python = venv_python(args.venv.resolve())
    try:
        recipe = load_config_files([ROOT / "config.yaml", *args.configfile]).train
    except ConfigError as exc:
        raise SystemExit(str(exc)) from None
    p = TrainParams.model_validate(
        {
            **recipe.model_dump(),
            "micro_batch_budget_tokens": args.micro_batch_budget_tokens,
            "ttt_steps": 3,
            "num_draft_layers": 1,
            "epochs": 20,  # only --steps are taken
            "validation_fraction": 0.0,
            "num_gpus": 0,
        }
    )
    with tempfile.TemporaryDirectory(prefix="bench_speculators_") as tmp:
        tmp = Path(tmp)
        need = int(1.3 * (args.steps + 2) * args.micro_batch_budget_tokens)
        ours_manifest, shard, lengths, aux_ids = subset(
            manifest, verifier, args.samples, need, tmp / "ours"
        )
        print(f"inputs: {manifest}: {len(lengths)} samples, {sum(lengths)} tokens", flush=True)
        aux_order = sorted(range(len(aux_ids)), key=lambda i: aux_ids[i])
        spec = tmp / "speculators"
        convert = {
            "shard": str(shard), "out": str(spec), "verifier": str(verifier.resolve()),
            "vocab_map": str(vocab_map.resolve()), "aux_order": aux_order,
            "dtype": args.hidden_states_dtype,
        }  # fmt: skip
        done = subprocess.run(
            [python, "-c", CONVERT, json.dumps(convert)], capture_output=True, text=True
        )
        if done.returncode != 0:
            raise SystemExit(f"conversion to speculators' format failed:\n{done.stderr[-3000:]}")
        converted = json.loads(done.stdout.strip().splitlines()[-1])

        io = scratch_io(ours_manifest, vocab_map, verifier, tmp / "probe")
        probe = Trainer(io, p, check_inputs(io, p), setup_processes(p))  # ours' plan of steps
        planned = [
            sum(lengths[int(g)] - 1 for ids in probe.plan.global_batch(s) for g in ids)
            for s in range(args.warmup, min(args.steps, probe.plan.total_steps))
        ]
        del probe
        total_seq_len = args.total_seq_len or round(statistics.mean(planned))
        flags = [
            "--speculator-type", "eagle3", "--verifier-name-or-path", converted["verifier"],
            "--data-path", str(spec), "--target-layer-ids", *map(str, sorted(aux_ids)),
            "--num-layers", "1", "--draft-vocab-size", str(converted["draft_vocab_size"]),
            "--ttt-steps", "3", "--total-seq-len", str(total_seq_len), "--epochs", "1",
            "--max-steps", str(args.steps), "--draft-attn-impl", "sdpa",
            "--loss-implementation", "eager", "--hidden-states-dtype", args.hidden_states_dtype,
            "--num-workers", "0", "--train-data-ratio", "0.99", "--mask-token-id", "0",
            "--log-freq", "1", "--no-resume-from-checkpoint",
        ]  # fmt: skip
        print(
            f"{args.steps} steps a run ({args.warmup} not counted), {args.threads} thread(s); "
            f"ours: micro-batches of <= {args.micro_batch_budget_tokens} tokens (padding "
            f"included), theirs: --total-seq-len {total_seq_len}",
            flush=True,
        )
        runs: dict[str, list[dict]] = {"ours": [], "speculators": []}
        for r in range(args.rounds):
            for name in ("ours", "speculators") if r % 2 == 0 else ("speculators", "ours"):
                work = tmp / f"{name}-{r}"
                if name == "ours":
                    io = scratch_io(ours_manifest, vocab_map, verifier, work)
                    result = run_ours(io, p, args.steps, args.warmup)
                else:
                    result = run_theirs(python, flags, work, args.threads, args.warmup)
                runs[name].append(result)
                print(
                    f"round {r + 1} {name:>11}: {result['tokens_per_s']:9.0f} tokens/s "
                    f"({result['tokens_per_step']:.0f} tokens/step)",
                    flush=True,
                )
    best = {n: max(r["tokens_per_s"] for r in rs) for n, rs in runs.items()}
    median = {n: statistics.median(r["tokens_per_s"] for r in rs) for n, rs in runs.items()}
    ratio = best["ours"] / best["speculators"]
    median_ratio = median["ours"] / median["speculators"]
    print(f"\ntraining tokens/s, best (median) of {args.rounds} run(s) each:")
    for name in runs:
        print(f"  {name:>11}: {best[name]:9.0f} ({median[name]:.0f})")
    print(f"  ratio ours/speculators: {ratio:.3f} (median {median_ratio:.3f}; target >= 0.8)")
    if args.json:
        figures = {
            "inputs": {"manifest": str(manifest), "samples": len(lengths), "tokens": sum(lengths)},
            "settings": {
                **vars(args),
                "total_seq_len": total_seq_len,
                "torch_threads": args.threads,
            },
            "runs": runs,
            "best_tokens_per_s": best,
            "median_tokens_per_s": median,
            "ratio": ratio,
            "median_ratio": median_ratio,
        }
        args.json.write_text(json.dumps(figures, indent=2, default=str) + "\n")
        print(f"figures: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
