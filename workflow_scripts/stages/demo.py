"""demo: the embedded default, built offline: chat data, a tokenizer and a tiny Llama verifier.

1. Generates ``chat_data.jsonl`` (rule-based multi-turn conversations, see ``lib/demo_data.py``) and
   ``eval_prompts.jsonl`` (held-out prompts with their expected answers under ``reference``).
2. Trains a byte-level BPE tokenizer on the data with Llama-3 special tokens and chat template.
3. Trains a small ``LlamaForCausalLM`` on the assistant tokens (the same mask that ``prepare``
   builds), with conversations packed into rows, and checks it by greedy generation on the
   held-out prompts (the accuracy is logged and written to ``demo_report.json``).
4. Writes the verifier directory (float32 safetensors, config, generation config, tokenizer)
   under a temporary name and renames it when complete.

The tokenizer and the verifier are made in ``lib/demo_verifier.py``. The same seed gives byte-identical data and tokenizer files on any machine, and an identical
verifier directory on the same kind of CPU with the same software versions (on this project's
machines, also with 1 or 2 threads). The verifier trains on the first train_steps x train_batch_size_samples
conversations of the generator's stream, which begins with chat_data and goes on with fresh
conversations (with the defaults, eight times as many as chat_data holds), so that it learns the
rules rather than the examples.
"""

from __future__ import annotations

import logging
import os
import time

from workflow_scripts.lib import cli
from workflow_scripts.lib.common import UserError, format_seconds, run_main
from workflow_scripts.lib.demo_data import (
    generate_conversations,
    generate_eval_prompts,
    iter_conversations,
)
from workflow_scripts.lib.demo_verifier import (
    build_tokenizer,
    evaluate,
    train_verifier,
    write_jsonl,
    write_verifier,
)

log = logging.getLogger("eagle3")


def main() -> None:
    io, p = cli.parse("demo")
    # Threads that wait passively: with active waiting (the OpenMP default), a CPU shared with
    # other jobs made training several times slower than with one thread.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch

    for path in (io.verifier, io.chat_data, io.eval_prompts):
        path.parent.mkdir(parents=True, exist_ok=True)
        if not os.access(path.parent, os.W_OK):
            raise UserError(f"cannot write {path}: {path.parent} is not writable")

    threads = len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    t0 = time.monotonic()
    log.info(
        "demo: seed %d, %d conversations, %d held-out prompts, %d threads",
        p.seed,
        p.num_conversations,
        p.num_eval_prompts,
        threads,
    )

    rows = generate_conversations(p.seed, p.num_conversations)
    try:
        eval_rows = generate_eval_prompts(p.seed, p.num_eval_prompts)
    except ValueError as exc:
        raise UserError(f"demo.num_eval_prompts = {p.num_eval_prompts}: {exc}") from None
    tokenizer = build_tokenizer(rows, p.tokenizer_vocab_size)
    log.info(
        "demo: generated the data and a tokenizer of %d tokens in %.1fs",
        len(tokenizer),
        time.monotonic() - t0,
    )

    # The verifier learns the rules from the generator's stream of conversations, which begins
    # with chat_data and goes on with fresh ones, so that it generalises instead of memorising.
    # None of them contains a held-out prompt.
    model, train_report = train_verifier(p, tokenizer, iter_conversations(p.seed))
    eval_report = evaluate(model, tokenizer, eval_rows)
    log.info(
        "demo: held-out prompts answered exactly right: %.1f%% of %d; by family: %s",
        100 * eval_report["exact_match"],
        len(eval_rows),
        ", ".join(f"{f} {v:.0%}" for f, v in eval_report["exact_match_by_family"].items()),
    )
    for bad in eval_report["examples_wrong"][:5]:
        log.info(
            "demo: wrong: %r -> %r (expected %r)", bad["prompt"], bad["answer"], bad["reference"]
        )

    report = {
        "params": p.model_dump(),
        "train": train_report,
        "eval": eval_report,
    }
    write_jsonl(io.chat_data, rows)
    write_jsonl(io.eval_prompts, eval_rows)
    write_verifier(model, tokenizer, io.verifier, report)
    log.info(
        "demo: done in %s: %s, %s, %s",
        format_seconds(time.monotonic() - t0),
        io.verifier,
        io.chat_data,
        io.eval_prompts,
    )


if __name__ == "__main__":
    run_main(main)
