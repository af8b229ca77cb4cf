"""prepare's tokenization at the users' size, with 1 and with 2 worker processes side by side.

Writes --conversations synthetic conversations (100,000 by default) as reasoning and
tool-calling verifiers write them, in the forms docs/chat-data.md lists: multi-turn, 4,000 to
8,000 tokens each; reasoning as reasoning_content, reasoning, thinking or inline <think>; tool
calls with arguments as an object or a JSON string, their results as role tool, ipython or
function; a row-level tools list; some rows in ShareGPT form. The text is prose from the
docstrings of an installed package (lib/demo/docs.py; nothing is downloaded). The verifier is
the embedded demo's reasoning_tools chat format (lib/demo/formats.py QWEN3: its template drops
earlier reasoning, so a conversation takes one row per user turn) on a BPE tokenizer trained on
the first conversations (lib/demo/verifier.py).

The conversations are written as --rounds chat files; each round runs prepare's tokenization
(chat.tokenization.tokenize_chat_file, as the stage calls it, its output written to disk) on one file
with each process count in turn, so that other work on the machine weighs on each count alike.
Prints, per process count: conversations per second, tokens written per second, the CPU time of
the calling process (with workers: what reading, writing and counting cost it), the ratio to the
first count, and whether every output was the same bytes as the first count's; and the load
average after each round (its own processes included: about 1 while one process runs, 2 while
two do; more means other work).

    .venv/bin/python benchmarks/bench_prepare.py [--conversations 100000] [--processes 1 2]

With --turns (8 32 128, say): agentic conversations instead, of one user request answered over
that many assistant turns (reasoning and a tool call each, then its result; a final answer),
each of --turn-tokens tokens whatever the turns, --conversations of them per turn count, in one
process. Each turn count's file is tokenized as prepare does and as it did with every served
prompt tokenized whole (chat/turns.py's ``whole``), alternately: per turn count the tokens per
second of both, the ratio of each rate to the fewest turns', and whether both wrote the same
bytes.

    .venv/bin/python benchmarks/bench_prepare.py --turns 8 32 128 --conversations 40
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import sys
import tempfile
import time
from collections import Counter
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from workflow_scripts.lib.chat.tokenization import tokenize_chat_file  # noqa: E402
from workflow_scripts.lib.chat.template import load_template  # noqa: E402
from workflow_scripts.lib.common import Progress, sha256_file  # noqa: E402
from workflow_scripts.lib.demo.docs import read_documents  # noqa: E402
from workflow_scripts.lib.demo.formats import QWEN3  # noqa: E402
from workflow_scripts.lib.demo.verifier import build_tokenizer, save_tokenizer  # noqa: E402
from workflow_scripts.lib.workflow.params_base import ChatTemplateSettings  # noqa: E402

CHARS_PER_TOKEN = 4  # of this prose under the tokenizer below; the run prints the real figure
TOKENIZER_VOCAB = 8192
TOKENIZER_SAMPLE = 300  # conversations the tokenizer is trained on
REASONING_FORMS = ["reasoning_content", "reasoning", "thinking", "inline"]
TOOL_ROLES = ["tool", "ipython", "function"]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {key: {"type": "string", "description": f"The {key}."}},
                "required": [key],
            },
        },
    }
    for name, key, description in [
        ("search_docs", "query", "Search the documentation and return the best passages."),
        ("read_page", "path", "Read one page of the documentation."),
        ("run_example", "code", "Run a code example and return what it prints."),
    ]
]


class Text:
    """Prose in pieces of about a given length, from a pool of paragraphs."""

    def __init__(self, paragraphs: list[str], rng: random.Random):
        self.paragraphs, self.rng = paragraphs, rng

    def __call__(self, tokens: int) -> str:
        out, size = [], 0
        while size < tokens * CHARS_PER_TOKEN:
            out.append(self.rng.choice(self.paragraphs))
            size += len(out[-1]) + 2
        return "\n\n".join(out)


def assistant(text: Text, tokens: int, form: str) -> dict:
    """An assistant message with reasoning (about 60% of ``tokens``) in ``form``."""
    reasoning, answer = text(tokens * 6 // 10), text(tokens * 4 // 10)
    if form == "inline":
        return {"role": "assistant", "content": f"<think>\n{reasoning}\n</think>\n\n{answer}"}
    return {"role": "assistant", form: reasoning, "content": answer}


def tool_chain(text: Text, rng: random.Random, tokens: int, i: int, turn: int) -> list[dict]:
    """An assistant turn through tools: reasoning and one or two calls, their results, then
    reasoning and the answer."""
    calls = []
    for c in range(rng.choice([1, 1, 2])):
        tool = rng.choice(TOOLS)["function"]
        key = next(iter(tool["parameters"]["properties"]))
        args = {key: text(12)[:80]}
        calls.append(
            {
                "id": f"call_{i}_{turn}_{c}",
                "type": "function",
                "function": {
                    "name": tool["name"],
                    "arguments": args if (i + c) % 2 else json.dumps(args),
                },
            }
        )
    first = {
        "role": "assistant",
        REASONING_FORMS[turn % 3]: text(tokens // 5),
        "content": "",
        "tool_calls": calls,
    }
    results = [
        {
            "role": TOOL_ROLES[(i + c) % len(TOOL_ROLES)],
            "tool_call_id": call["id"],
            "name": call["function"]["name"],
            "content": text(tokens // (3 * len(calls))),
        }
        for c, call in enumerate(calls)
    ]
    return [first, *results, assistant(text, tokens // 2, REASONING_FORMS[turn % 4])]


def conversation(text: Text, rng: random.Random, i: int) -> dict:
    """One conversation of 4,000 to 8,000 tokens: a system prompt, two to four user turns, each
    answered directly or through tools (in rows with a tools list)."""
    total = rng.randint(4000, 8000)
    turns = rng.choice([2, 3, 3, 4])
    with_tools = rng.random() < 0.5
    sharegpt = not with_tools and i % 10 == 0  # with reasoning inline, as ShareGPT has it
    messages = [{"role": "system", "content": text(60)}]
    for turn in range(turns):
        budget = total // turns
        messages.append({"role": "user", "content": text(budget // 10)})
        if with_tools and rng.random() < 0.6:
            messages += tool_chain(text, rng, budget * 9 // 10, i, turn)
        else:
            form = "inline" if sharegpt else REASONING_FORMS[(i + turn) % 4]
            messages.append(assistant(text, budget * 9 // 10, form))
    row: dict = {"id": f"bench-{i:06d}", "messages": messages}
    if with_tools:
        row["tools"] = TOOLS
    if sharegpt:
        names = {"system": "system", "user": "human", "assistant": "gpt"}
        said = [{"from": names[m["role"]], "value": m["content"]} for m in messages]
        return {"id": row["id"], "conversations": said}
    return row


def agentic(text: Text, rng: random.Random, i: int, turns: int, tokens: int) -> dict:
    """One request answered over ``turns`` assistant turns, ``tokens`` tokens in all: each turn
    but the last reasons and calls a tool, whose result follows; the last answers."""
    per = tokens * 9 // 10 // turns
    messages = [
        {"role": "system", "content": text(60)},
        {"role": "user", "content": text(tokens // 20)},
    ]
    for turn in range(turns - 1):
        tool = TOOLS[turn % len(TOOLS)]["function"]
        key = next(iter(tool["parameters"]["properties"]))
        call = {"id": f"call_{i}_{turn}", "type": "function",
                "function": {"name": tool["name"], "arguments": {key: text(8)[:60]}}}  # fmt: skip
        messages.append(
            {"role": "assistant", "reasoning_content": text(per * 4 // 10), "content": "",
             "tool_calls": [call]}  # fmt: skip
        )
        messages.append({"role": "tool", "tool_call_id": call["id"], "name": tool["name"],
                         "content": text(per * 5 // 10)})  # fmt: skip
    messages.append(assistant(text, per, "reasoning_content"))
    return {"id": f"agentic-{turns}-{i:05d}", "messages": messages, "tools": TOOLS}


def run_turns(args, work: Path) -> None:
    """--turns: the agentic conversations of each turn count, tokenized as prepare does and
    with every prompt whole, alternately; the table."""
    from workflow_scripts.lib.chat import tokenization, turns as chat_turns

    paragraphs = [p for doc in read_documents(["networkx"]) for p in doc.paragraphs]
    rng = random.Random(f"bench-prepare-turns-{args.seed}")
    text = Text(paragraphs, rng)
    files = {}
    for n in args.turns:
        files[n] = work / f"agentic_{n}.jsonl"
        rows = [agentic(text, rng, i, n, args.turn_tokens) for i in range(args.conversations)]
        files[n].write_text("".join(json.dumps(r) + "\n" for r in rows))
    sample = [json.loads(line) for f in files.values() for line in f.read_text().splitlines()]
    verifier = build_verifier(work / "verifier", sample[:TOKENIZER_SAMPLE])
    linear = tokenization.conversation_turns
    whole = partial(chat_turns.conversation_turns, whole=True)
    results = {}
    for n, path in files.items():
        for name, turns_of in (("linear", linear), ("whole", whole)):
            tokenization.conversation_turns = turns_of
            try:
                results[n, name] = run(path, verifier, 1, 1 << 20, work / "out.jsonl")
            finally:
                tokenization.conversation_turns = linear
            r = results[n, name]
            print(f"{n} turns, {name}: {r['stats']['tokens'] / r['seconds']:,.0f} tokens/s",
                  flush=True)  # fmt: skip
    first = args.turns[0]

    def rate(n: int, name: str) -> float:
        r = results[n, name]
        return r["stats"]["tokens"] / r["seconds"]

    print(f"\n{args.conversations} conversations of {args.turn_tokens} tokens per turn count, "
          "one process\n")  # fmt: skip
    print("| turns | tokens written | rows | tokens/s | tokens/s, every prompt whole | "
          f"rate against {first} turns | whole: against {first} turns | same bytes |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for n in args.turns:
        stats = results[n, "linear"]["stats"]
        same = results[n, "linear"]["sha256"] == results[n, "whole"]["sha256"]
        print(
            f"| {n} | {stats['tokens']:,} | {stats['rows_out']} | {rate(n, 'linear'):,.0f} | "
            f"{rate(n, 'whole'):,.0f} | {rate(first, 'linear') / rate(n, 'linear'):.2f}x slower | "
            f"{rate(first, 'whole') / rate(n, 'whole'):.2f}x slower | {same} |"
        )


def write_data(work: Path, n: int, rounds: int, seed: int) -> tuple[list[Path], list[dict]]:
    """The ``n`` conversations, as ``rounds`` chat files of about equal size; and the first
    TOKENIZER_SAMPLE conversations."""
    paragraphs = [p for doc in read_documents(["networkx"]) for p in doc.paragraphs]
    rng = random.Random(f"bench-prepare-{seed}")
    text = Text(paragraphs, rng)
    sample, paths = [], []
    for r in range(rounds):
        paths.append(work / f"chat_{r:03d}.jsonl")
        with open(paths[-1], "w", encoding="utf-8") as fh:
            for i in range(r * n // rounds, (r + 1) * n // rounds):
                row = conversation(text, rng, i)
                if i < TOKENIZER_SAMPLE:
                    sample.append(row)
                fh.write(json.dumps(row) + "\n")
    return paths, sample


def build_verifier(out: Path, sample: list[dict]) -> Path:
    """The demo's QWEN3 chat format on a BPE tokenizer trained on ``sample``."""
    rows = [r for r in sample if "messages" in r]
    tokenizer = build_tokenizer(rows, TOKENIZER_VOCAB, QWEN3)
    tokenizer.model_max_length = 1 << 30  # no warning on a long conversation
    save_tokenizer(tokenizer, out)
    stops = tokenizer.convert_tokens_to_ids(QWEN3.stops)
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": stops}) + "\n")
    return out


def run(data: Path, verifier: Path, processes: int, max_len: int, out: Path) -> dict:
    """One chat file through prepare's tokenization with ``processes`` processes: wall and CPU
    seconds of this process, the statistics, and the output's sha256."""
    settings = ChatTemplateSettings()
    template = load_template(verifier, settings)
    start, cpu = time.perf_counter(), time.process_time()
    with open(out, "w", encoding="utf-8") as fh:
        stats = tokenize_chat_file(
            data,
            template,
            max_len,
            "skip",
            fh,
            Progress(f"{data.name}, {processes} processes", None, interval_s=60),
            processes=processes,
            load=partial(load_template, verifier, settings),
        )
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    digest = sha256_file(out)
    out.unlink()
    return {"seconds": seconds, "cpu_s": cpu, "stats": stats, "sha256": digest}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversations", type=int, default=100_000)
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2])
    parser.add_argument(
        "--rounds",
        type=int,
        default=10,
        help="the data is cut into this many files; each round tokenizes one with each process "
        "count in turn, so that other work on the machine weighs on each count alike",
    )
    parser.add_argument("--max-seq-len-tokens", type=int, default=8192)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", type=Path, default=None, help="default: a temporary one")
    parser.add_argument(
        "--turns", type=int, nargs="+", help="agentic conversations of these turn counts instead"
    )
    parser.add_argument("--turn-tokens", type=int, default=16000, help="with --turns: tokens each")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    if args.turns:
        with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
            run_turns(args, Path(tmp))
        return

    seconds = {n: 0.0 for n in args.processes}
    cpu = {n: 0.0 for n in args.processes}
    same = {n: True for n in args.processes}
    loads = [os.getloadavg()[0]]
    totals: Counter = Counter()
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        work = Path(tmp)
        start = time.perf_counter()
        files, sample = write_data(work, args.conversations, args.rounds, args.seed)
        verifier = build_verifier(work / "verifier", sample)
        size = sum(f.stat().st_size for f in files)
        print(
            f"data: {args.conversations} conversations, {size / 1e9:.2f} GB in {len(files)} "
            f"files, written in {time.perf_counter() - start:.0f} s; "
            f"{len(os.sched_getaffinity(0))} cores; load average {loads[0]:.2f}",
            flush=True,
        )
        for r, data in enumerate(files):
            first = None
            for n in args.processes:
                result = run(data, verifier, n, args.max_seq_len_tokens, work / "out.jsonl")
                seconds[n] += result["seconds"]
                cpu[n] += result["cpu_s"]
                first = first or result
                same[n] &= (result["sha256"], result["stats"]) == (first["sha256"], first["stats"])
            stats = first["stats"]
            for key in ("rows_in", "conversations_out", "rows_out", "tokens", "unique_tokens"):
                totals[key] += stats[key]
            loads.append(os.getloadavg()[0])
            print(
                f"round {r + 1}/{len(files)}: "
                + ", ".join(f"{n} processes {seconds[n]:.0f} s" for n in args.processes)
                + f" so far; load average {loads[-1]:.2f}",
                flush=True,
            )

    conversations = totals["conversations_out"]
    print(
        f"\nper conversation: {totals['unique_tokens'] / conversations:.0f} tokens, "
        f"{totals['rows_out'] / conversations:.2f} rows of "
        f"{totals['tokens'] / totals['rows_out']:.0f} tokens (max_seq_len_tokens "
        f"{args.max_seq_len_tokens}); load average (1 min, this run's processes included) from "
        f"{min(loads):.2f} to "
        f"{max(loads):.2f}, mean {sum(loads) / len(loads):.2f}\n"
    )
    print(
        "| processes | seconds | conversations/s | tokens written/s | this process's CPU s "
        "| ratio to first | same bytes |"
    )
    print("|---|---|---|---|---|---|---|")
    base = seconds[args.processes[0]]
    for n in args.processes:
        print(
            f"| {n} | {seconds[n]:.0f} | {totals['rows_in'] / seconds[n]:.1f} | "
            f"{totals['tokens'] / seconds[n]:,.0f} | {cpu[n]:.0f} | {base / seconds[n]:.2f} | "
            f"{same[n]} |"
        )


if __name__ == "__main__":
    main()
