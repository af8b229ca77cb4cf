"""Where every output lives under ``<results_dir>/``: the one place that names the workflow's
files. The rules declare their outputs from it, the dry-run and the library read them through it,
and the benchmarks and tests look at them through it.

    layout = Layout("results")
    layout.extract.manifest        # results/extract/manifest.json
    layout.extract.part("{job_index}")
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# The names of the records stages hand each other, where a stage writes one in a directory it is
# given (training's resume state, a test's own tree).
MANIFEST = "manifest.json"
STATS = "stats.json"
RESULTS = "results.json"
METRICS = "metrics.jsonl"
STREAM_PLAN = "stream_plan.json"
CHAT_DATA = "chat_data.jsonl"
TOKENIZED = "tokenized_data.jsonl"


@dataclass(frozen=True)
class StageDir:
    """A stage's directory, ``<results_dir>/<stage>/``."""

    dir: Path

    @property
    def stats(self) -> Path:
        """The stage's statistics (data, regenerate, prepare, vocab)."""
        return self.dir / STATS


class Demo(StageDir):
    """The embedded default's data and verifier."""

    @property
    def chat_data(self) -> Path:
        return self.dir / CHAT_DATA

    @property
    def eval_prompts(self) -> Path:
        return self.dir / "eval_prompts.jsonl"

    @property
    def verifier(self) -> Path:
        return self.dir / "verifier"


class Data(StageDir):
    @property
    def chat_data(self) -> Path:
        """The mixture of the chat data's sources."""
        return self.dir / CHAT_DATA


class JobsStage(StageDir):
    """A stage of data-parallel jobs (regenerate, extract): a part per job, then one merge."""

    def part(self, job_index: int | str) -> Path:
        return self.dir / "parts" / f"part_{job_index}.json"


class Regenerate(JobsStage):
    @property
    def batches(self) -> Path:
        """Every job's finished batches (no rule's output: a rerun job reuses them)."""
        return self.dir / "batches"

    @property
    def chat_data(self) -> Path:
        """The chat data with the verifier's own answers."""
        return self.dir / CHAT_DATA


class Prepare(StageDir):
    @property
    def tokenized(self) -> Path:
        return self.dir / TOKENIZED


class Vocab(StageDir):
    @property
    def vocab_map(self) -> Path:
        return self.dir / "vocab_map.safetensors"


class Extract(JobsStage):
    @property
    def shards(self) -> Path:
        """The finished shards (no rule's output: a rerun job reuses them)."""
        return self.dir / "shards"

    @property
    def manifest(self) -> Path:
        return self.dir / MANIFEST

    @property
    def stream_plan(self) -> Path:
        """With extract.disk_budget: every shard's samples and bytes (rule extract_plan)."""
        return self.dir / STREAM_PLAN

    @property
    def stream_shards(self) -> Path:
        """With extract.disk_budget: the shards the engine computes for training."""
        return self.dir / "stream"


class Train(StageDir):
    @property
    def draft(self) -> Path:
        return self.dir / "draft"

    @property
    def metrics(self) -> Path:
        return self.dir / METRICS

    @property
    def state(self) -> Path:
        """The resume state (no rule's output: a rerun continues from it)."""
        return self.dir / "state"


class Evaluate(StageDir):
    @property
    def results(self) -> Path:
        return self.dir / RESULTS

    @property
    def reference(self) -> Path:
        """The engines without a draft (rule evaluate_reference), what every draft is held to."""
        return self.dir / "reference.json"

    @property
    def plots(self) -> Path:
        return self.dir / "plots"


class Export(StageDir):
    def draft(self, engine: str) -> Path:
        """The draft in ``engine``'s layout (lib/draft/export.py)."""
        return self.dir / engine


@dataclass(frozen=True)
class Layout:
    """Every path under ``root`` (a results_dir)."""

    root: Path

    def __init__(self, root: Path | str):
        object.__setattr__(self, "root", Path(root))

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def benchmarks(self) -> Path:
        return self.root / "benchmarks"

    @property
    def code(self) -> Path:
        """The stages' code fingerprints (lib/workflow/code_inputs.py), one file each."""
        return self.root / "code"

    @property
    def nodes(self) -> Path:
        """Where the nodes of a job over several nodes meet (lib/workflow/nodes.py)."""
        return self.root / "nodes"

    @property
    def sources_lock(self) -> Path:
        """The hub datasets' pinned commits (lib/data/resolve.py)."""
        return self.root / "sources.lock.json"

    @property
    def resolved_config(self) -> Path:
        return self.root / "config.resolved.yaml"

    def verifier(self, configured: str | Path | None) -> Path:
        """The verifier a run serves: ``configured`` (the config's ``verifier``), else the
        embedded default's, which the demo stage builds here."""
        return Path(configured) if configured else self.demo.verifier

    demo = property(lambda self: Demo(self.root / "demo"))
    data = property(lambda self: Data(self.root / "data"))
    regenerate = property(lambda self: Regenerate(self.root / "regenerate"))
    prepare = property(lambda self: Prepare(self.root / "prepare"))
    vocab = property(lambda self: Vocab(self.root / "vocab"))
    extract = property(lambda self: Extract(self.root / "extract"))
    train = property(lambda self: Train(self.root / "train"))
    evaluate = property(lambda self: Evaluate(self.root / "evaluate"))
    export = property(lambda self: Export(self.root / "export"))
