"""The trained draft served by vLLM on prompts of its own training data, beside what the evaluation
served on held-out prompts and what training simulated: where served and simulated acceptance
part, this tells serving (the same low figure on training prompts) from generalization (a high
one there, a low one on prompts of other tasks).

    python benchmarks/bench_served_on_train.py [--configfile FILE ...] [--directory DIR]
        [--prompts 24] [--max-new-tokens 256]

It serves a build made in DIR (by default this directory) with the config files given as to
Snakemake (benchmarks/bench_serving.py: build_config): its draft, verifier and chat data. The
prompts are the first user turn (with the system turn before it) of every n-th conversation of the
chat data training took (the regenerated one where regeneration ran), greedy, served by an engine
made as the evaluate stage makes it from those files' evaluate settings (k =
evaluate.num_speculative_tokens). Most of them were trained on (the held-out split is
train.validation_fraction).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.bench_serving import build_config  # noqa: E402


def first_turns(chat_data: Path, count: int) -> list[list[dict]]:
    rows = [json.loads(line) for line in chat_data.open()]
    picked = []
    for row in rows[:: max(1, len(rows) // count)][:count]:
        messages = []
        for m in row["messages"]:
            messages.append({"role": m["role"], "content": m["content"]})
            if m["role"] == "user":
                break
        picked.append(messages)
    return picked


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--configfile", type=Path, nargs="+", default=[], help="as to Snakemake")
    ap.add_argument("--directory", type=Path, default=Path("."), help="the build's working dir")
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    a = ap.parse_args()

    from transformers import AutoTokenizer
    from vllm import SamplingParams

    from workflow_scripts.lib.evaluation.acceptance import _counter
    from workflow_scripts.lib.verifier import engine, preflight
    from workflow_scripts.lib.verifier.files import verifier_config

    cfg, layout = build_config(a.directory, a.configfile)
    p = cfg.evaluate  # the settings evaluate ran with
    verifier = layout.verifier(cfg.verifier)
    chat_data = layout.regenerate.chat_data if cfg.regenerate.enabled else layout.data.chat_data
    tokenizer = AutoTokenizer.from_pretrained(verifier)
    prompts = []
    for messages in first_turns(chat_data, a.prompts):
        rendered = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=True
        )
        prompts.append({"prompt_token_ids": list(rendered["input_ids"])})
    # the engine as the evaluate stage makes it, from the run's own evaluate settings
    preflight.check_evaluate(p, verifier_config(verifier))
    dtype = engine.resolve_dtype(p, verifier_config(verifier))
    kwargs = engine.engine_args(p, verifier, dtype, disable_log_stats=False)
    backend = {key: v for key, v in kwargs.items() if key == "attention_backend"}
    kwargs["speculative_config"] = {
        "method": "eagle3",
        "model": str(layout.train.draft),
        "num_speculative_tokens": p.num_speculative_tokens,
        **backend,
    }
    llm = engine.make_llm(kwargs, use_gpus=p.use_gpus)
    before = llm.get_metrics()
    start = time.perf_counter()
    llm.generate(
        prompts, SamplingParams(max_tokens=a.max_new_tokens, temperature=0), use_tqdm=False
    )
    after = llm.get_metrics()
    drafts, accepted = (
        _counter(after, f"vllm:spec_decode_num_{n}") - _counter(before, f"vllm:spec_decode_num_{n}")
        for n in ("drafts", "accepted_tokens")
    )
    evaluated = json.loads(layout.evaluate.results.read_text())["summary"]
    print(json.dumps({
        "training_prompts": len(prompts),
        "served_on_training_prompts": round(1 + accepted / drafts, 3),
        "served_on_held_out_prompts": round(evaluated["eagle3_mean_acceptance_length"], 3),
        "simulated_on_held_out_split": evaluated["eagle3_simulated_acceptance_length"],
        "seconds": round(time.perf_counter() - start),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
