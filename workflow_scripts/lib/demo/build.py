"""The demo stage's work (``build_demo``): the corpus ``demo.corpus`` names (``corpus_for``), its
data generated, and the verifier built for it or converted (stages/demo.py has the whole story).
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable, Iterator

from workflow_scripts.lib.common import UserError, format_seconds
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
from workflow_scripts.lib.workflow.definitions import DemoParams
from workflow_scripts.lib.workflow.registry import DemoIO

log = logging.getLogger("eagle3")


def corpus_for(p: DemoParams) -> tuple[Callable, Callable, Iterator | None, list | None]:
    """The corpus ``demo.corpus`` names: how its chat data and held-out prompts are made, the
    stream of conversations the verifier learns from (None for a pretrained one) and the rows
    its tokenizer learns (None: chat_data's)."""
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
    return make_rows, make_eval, stream, tokenizer_rows


def build_demo(io: DemoIO, p: DemoParams) -> None:
    """Writes the demo's verifier, chat data and held-out prompts (the stage's docstring)."""
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

    make_rows, make_eval, stream, tokenizer_rows = corpus_for(p)
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
