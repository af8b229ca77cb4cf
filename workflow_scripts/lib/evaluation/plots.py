"""The evaluation's plots: acceptance per draft position and by context length (vLLM's, with 95%
intervals over prompts, and what training simulated), the draft against n-gram, the speedup
against the requests in flight, and the training curves."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from workflow_scripts.lib.workflow.records import MetricsRow


def plot(results: dict[str, Any], metrics_path: Path, plot_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plot_dir.mkdir(parents=True, exist_ok=True)
    runs = {k: v for k, v in results["runs"].items() if v["num_drafts"]}

    fig, ax = plt.subplots(figsize=(6, 4))
    width = 0.8 / max(len(runs), 1)
    for i, (name, run) in enumerate(runs.items()):
        rates = run["acceptance_rate_per_position"]
        ci = (run.get("per_prompt") or {}).get("acceptance_rate_per_position_ci95")
        errors = None
        if ci and len(ci) == len(rates):
            errors = [
                [max(r - lo, 0) for r, (lo, _) in zip(rates, ci)],
                [max(hi - r, 0) for r, (_, hi) in zip(rates, ci)],
            ]
        ax.bar(
            [p + 1 + (i - (len(runs) - 1) / 2) * width for p in range(len(rates))],
            rates,
            width=width,
            yerr=errors,
            capsize=3,
            label=f"{name} (mean acceptance length {run['mean_acceptance_length']:.2f})",
        )
    simulated = results.get("simulated")
    if simulated:
        rates = simulated["acceptance_rate_per_position"]
        ax.plot(
            range(1, len(rates) + 1),
            rates,
            "k_",
            markersize=20,
            markeredgewidth=2,
            label=f"eagle3 simulated in training (step {simulated['step']}, held-out)",
        )
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate")
    ax.set_ylim(0, 1)
    ax.set_title("Acceptance per draft position")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(plot_dir / "acceptance_per_position.png", dpi=120)
    plt.close(fig)

    # vLLM's acceptance length counts the steps that drafted; n-gram drafts only where it finds
    # a match, so beside it the output tokens over all the verifier's passes
    fig, ax = plt.subplots(figsize=(6, 4))
    names = list(runs)
    for i, (key, label) in enumerate(
        (("mean_acceptance_length", "acceptance length (steps that drafted)"),
         ("tokens_per_verifier_pass", "output tokens a verifier pass"))
    ):  # fmt: skip
        values = [runs[n].get(key) or 0 for n in names]
        ax.bar([j + (i - 0.5) * 0.4 for j in range(len(names))], values, width=0.4, label=label)
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("tokens a step")
    ax.legend(fontsize=8)
    ax.set_title(
        f"k = {results['num_speculative_tokens']} (max {results['num_speculative_tokens'] + 1})"
    )
    ax.tick_params(axis="x", rotation=20)
    fig.tight_layout()
    fig.savefig(plot_dir / "draft_vs_ngram.png", dpi=120)
    plt.close(fig)

    plot_by_context(results, plot_dir / "acceptance_by_context.png")
    if results["speedups"]:
        plot_speedups(results["speedups"], plot_dir / "speedup_by_concurrency.png")

    rows = MetricsRow.read_all(metrics_path)
    train = [r for r in rows if r.split == "train"]
    val = [r for r in rows if r.split == "val"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for series, label in ((train, "train"), (val, "held-out")):
        if series:
            axes[0].plot([r.step for r in series], [r.loss for r in series], label=label)
    axes[0].set_xlabel("step")
    axes[0].set_ylabel("loss (forward KL)")
    axes[0].legend()
    source = val or train
    if source:
        for k in range(len(source[-1].acceptance_per_position)):
            axes[1].plot(
                [r.step for r in source],
                [r.acceptance_per_position[k] for r in source],
                label=f"position {k + 1}",
            )
        axes[1].set_ylim(0, 1)
        axes[1].legend()
    axes[1].set_xlabel("step")
    axes[1].set_ylabel(f"simulated acceptance per position ({'held-out' if val else 'train'})")
    fig.tight_layout()
    fig.savefig(plot_dir / "training_curves.png", dpi=120)
    plt.close(fig)


def plot_speedups(speedups: list[dict[str, Any]], path: Path) -> None:
    """Output tokens/s over the verifier alone's against the requests in flight, per set and
    over all of them (the draft's solid, n-gram's dashed)."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for i, name in enumerate(dict.fromkeys(s["set"] for s in speedups)):
        rows = [s for s in speedups if s["set"] == name]
        for run, style in (("eagle3", "-o"), ("ngram", "--s")):
            ax.plot([s["concurrency"] for s in rows], [s[run] for s in rows], style,
                    color="k" if name == "all" else f"C{i}", label=f"{name}: {run}")  # fmt: skip
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("requests in flight")
    ax.set_ylabel("speedup over the verifier alone")
    ax.set_title("Serving speed (output tokens/s, warm engines)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _tokens(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def plot_by_context(results: dict[str, Any], path: Path) -> None:
    """Mean acceptance length against the context length at the drafted position, per set
    (the draft's solid, n-gram's dashed), with 95% intervals over prompts; the buckets no
    drafted position reached are left out."""
    import matplotlib.pyplot as plt

    edges = results["context_edges_tokens"]
    labels = [f"{_tokens(lo)}-{_tokens(hi)}" for lo, hi in zip([0, *edges], edges)]
    fig, ax = plt.subplots(figsize=(7, 4))
    styles = {"eagle3": "-o", "ngram": "--s"}
    for i, (name, entry) in enumerate(results["sets"].items()):
        color = f"C{i}"
        for run, style in styles.items():
            buckets = [b for b in (entry.get(run) or {}).get("by_context", []) if b["num_steps"]]
            if not buckets:
                continue
            x = [edges.index(b["context_tokens"][1]) for b in buckets]
            y = [b["mean_acceptance_length"] for b in buckets]
            ci = [b["mean_acceptance_length_ci95"] for b in buckets]
            errors = [[max(v - lo, 0) for v, (lo, _) in zip(y, ci)],
                      [max(hi - v, 0) for v, (_, hi) in zip(y, ci)]]  # fmt: skip
            ax.errorbar(x, y, yerr=errors, fmt=style, color=color, capsize=3,
                        label=f"{name}: {run}")  # fmt: skip
    ax.set_xticks(range(len(edges)), labels, rotation=30)
    ax.set_xlabel("context length at the drafted position (tokens)")
    ax.set_ylabel("mean acceptance length")
    ax.set_ylim(1, results["num_speculative_tokens"] + 1)
    ax.set_title("Acceptance by context length")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
