"""The regenerate stage's generation rate against plain vLLM generation of the same prompts.

    python benchmarks/bench_regenerate_rate.py [VERIFIER_DIR] [--chat-data FILE]
        [--conversations N] [--passes N] [--config FILE] [--configfile FILE]
        [--set KEY=VALUE ...] [--json FILE]

In one run, with one engine (the stage's own ``make_engine``: prefix caching, max_num_seqs =
batch_size_samples) and the same settings (config.yaml's regenerate section, under an optional
--configfile, overridable with --set KEY=VALUE; enabled: true), on the first N conversations of
the chat data:

1. plain: ``llm.generate`` of every conversation's first prompt, all submitted at once with one
   SamplingParams (the settings' temperature and top_p, max_tokens = max_new_tokens_per_turn
   capped by the room left in max_model_len_tokens, the template's stop ids, no detokenizing).
   The prompts are the token ids the stage sends: rendered by the same ChatTemplate with the
   generation prompt, and encoded by it;
2. plain in batches: the same, submitted in batches of batch_size_samples one after another
   (the stage's unit), so that the cost of batching (each batch waits for its longest answer
   before the next is submitted) is told apart from the cost of the stage's own work;
3. stage: the stage's own code, the conversations read (``read_conversations``, timed too) and
   ``answer_batch`` called per batch of batch_size_samples, over the same conversations, only
   their first turns: each conversation's plan is cut after its first answer
   (``plan[: plan.index(None) + 1]``) before answer_batch sees it, so answer_batch runs
   unchanged (render, encode, a seeded SamplingParams per conversation, one engine call, the
   answer decoded and split) and makes exactly one round, over the prompts plain generation
   gets. Later rounds are left out: their prompts hold the verifier's own earlier answers,
   which plain generation could not be given without running the stage first. Conversations
   with nothing to answer (a tool call before any answer) are left out of all three.

A warm-up generates a few prompts both ways first (not timed; it also runs the template's
probes). Each method is timed over ``--passes`` passes, the methods interleaved pass by pass,
best pass kept (other jobs may share the machine), the prefix cache emptied before each run (the
first turns of a real run are fresh prompts). Prints, per method: prompts, prompt tokens,
generated tokens, seconds, generated tokens/s and the ratio to plain (target for the stage
>= 0.8); whether the generated ids of the stage (and of plain in batches) are identical to
plain's, as they should be at temperature 0, and how many differ; and the stage's host work
outside the engine (render and encode, SamplingParams, the answers decoded), measured apart.

VERIFIER_DIR defaults to results-real/demo/verifier, --chat-data to
results-real/data/chat_data.jsonl.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_extract import timed_passes  # noqa: E402
from benchmarks.workflow_run import with_settings  # noqa: E402
from workflow_scripts.lib.workflow.config import layered_files  # noqa: E402
from workflow_scripts.lib.chat.template import ChatTemplate, load_template  # noqa: E402
from workflow_scripts.lib.regeneration.answers import (  # noqa: E402
    Conversation,
    Index,
    answer_batch,
    index_input,
    make_engine,
    read_conversations,
    turn_seed,
)
from workflow_scripts.lib.verifier import engine, preflight  # noqa: E402
from workflow_scripts.lib.verifier.files import verifier_config, weight_files  # noqa: E402
from workflow_scripts.lib.workflow.config import load_config  # noqa: E402
from workflow_scripts.lib.workflow.definitions import RegenerateParams  # noqa: E402
from workflow_scripts.lib.workflow.registry import RegenerateIO  # noqa: E402

TARGET = 0.8
WARM_UP = 4  # prompts generated once before timing

# (prompt tokens, generated tokens, the generated ids of each conversation by its line number)
RunResult = tuple[int, int, dict[int, list[int]]]


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "verifier", nargs="?", type=Path, default=ROOT / "results-real" / "demo" / "verifier"
    )
    ap.add_argument(
        "--chat-data", type=Path, default=ROOT / "results-real" / "data" / "chat_data.jsonl"
    )
    ap.add_argument("--conversations", type=int, default=128, help="the first N rows of the data")
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--config", type=Path, default=ROOT / "config.yaml")
    ap.add_argument("--configfile", type=Path, help="a config layered over --config")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a regenerate setting (value parsed as YAML), e.g. --set temperature=0.7",
    )
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()
    if not (args.verifier / "config.json").is_file():
        ap.error(f"no verifier at {args.verifier} (give its directory)")
    if not args.chat_data.is_file():
        ap.error(f"no chat data at {args.chat_data} (give it with --chat-data)")
    if args.conversations < 1 or args.passes < 1:
        ap.error("--conversations and --passes must be at least 1")
    return args


def load_params(args: argparse.Namespace) -> RegenerateParams:
    raw = layered_files([args.config, *([args.configfile] if args.configfile else [])])
    return load_config(with_settings(raw, "regenerate", [*args.set, "enabled=true"])).regenerate


def copy_head(src: Path, dst: Path, rows: int) -> None:
    """The lines of ``src`` up to its ``rows``-th non-empty one, as they are (line numbers, and so
    the stage's per-turn seeds, stay those of the whole file)."""
    with open(src, "rb") as fh, open(dst, "wb") as out:
        for line in fh:
            out.write(line)
            rows -= bool(line.strip())
            if rows == 0:
                break


def first_turns(path: Path, index: Index) -> list[Conversation]:
    """The conversations of ``index`` with their plans cut after the first answer (answer_batch
    then makes one round); those with nothing to answer left out."""
    convs = []
    for conv in read_conversations(path, index, range(len(index.offsets))):
        if None in conv.plan:
            conv.plan = conv.plan[: conv.plan.index(None) + 1]
            convs.append(conv)
    return convs


def first_prompt_ids(template: ChatTemplate, conv: Conversation) -> list[int]:
    """The ids answer_batch serves for the conversation's first turn."""
    text = template.render(conv.plan[: conv.plan.index(None)], conv.tools, generation_prompt=True)
    return template.encode(text)


def batches(items: list, size: int) -> list[list]:
    return [items[start : start + size] for start in range(0, len(items), size)]


def differing(a: dict[int, list[int]], b: dict[int, list[int]]) -> int:
    return sum(a[key] != b.get(key) for key in a)


def main() -> None:
    args = parse_args()
    p = load_params(args)
    cfg = verifier_config(args.verifier)
    weight_files(args.verifier)
    preflight.check_engine(p, "regenerate", cfg)
    dtype = engine.resolve_dtype(p, cfg)
    template = load_template(args.verifier, p.chat_template)
    work = Path(tempfile.mkdtemp(prefix="bench_regenerate_rate_"))
    io = RegenerateIO(
        chat_data=work / "chat_data.jsonl",
        verifier=args.verifier,
        work_dir=work / "batches",
        job_index=0,
        part=work / "part.json",
    )
    try:
        run(args, p, template, dtype, io)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run(
    args: argparse.Namespace,
    p: RegenerateParams,
    template: ChatTemplate,
    dtype: str,
    io: RegenerateIO,
) -> None:
    """The benchmark on the first rows of the chat data, copied into ``io.chat_data``."""
    from vllm import SamplingParams

    copy_head(args.chat_data, io.chat_data, args.conversations)
    index = index_input(io.chat_data, p, template)  # the stage's checks (on_bad_row)
    convs = first_turns(io.chat_data, index)
    if not convs:
        sys.exit(f"{args.chat_data}: nothing to answer in the first {args.conversations} rows")
    B = p.batch_size_samples

    prompts: list[dict[str, list[int]]] = []
    by_cap: dict[int, Any] = {}
    caps = []
    for conv in convs:
        ids = first_prompt_ids(template, conv)
        cap = min(p.max_new_tokens_per_turn, p.max_model_len_tokens - len(ids))
        prompts.append({"prompt_token_ids": ids})
        caps.append(cap)
        if cap not in by_cap:
            by_cap[cap] = SamplingParams(
                temperature=p.temperature,
                top_p=p.top_p,
                max_tokens=cap,
                stop_token_ids=template.stop_ids,
                detokenize=False,
            )
    # one SamplingParams for every prompt (one per cap where a prompt leaves less room)
    params = [by_cap[cap] for cap in caps]
    shared = next(iter(by_cap.values())) if len(by_cap) == 1 else None
    line_nos = [conv.line_no for conv in convs]
    prompt_tokens = sum(len(x["prompt_token_ids"]) for x in prompts)
    print(
        f"verifier {args.verifier} ({dtype}); {len(convs)} conversations of the first "
        f"{args.conversations} rows of {args.chat_data} ({index.rows_in - len(index.offsets)} bad, "
        f"{len(index.offsets) - len(convs)} with nothing to answer), their first turns: "
        f"{prompt_tokens} prompt tokens; batch_size_samples {B}, temperature {p.temperature}, "
        f"max_new_tokens_per_turn {p.max_new_tokens_per_turn}, max_model_len_tokens "
        f"{p.max_model_len_tokens}",
        flush=True,
    )

    engine.check_devices(p, "regenerate", dtype=dtype, verifier=args.verifier)
    start = time.monotonic()
    llm = make_engine(io, p, dtype)
    print(f"engine ready after {time.monotonic() - start:.1f} s", flush=True)

    def plain(size: int) -> RunResult:
        generated: dict[int, list[int]] = {}
        for chunk in batches(list(range(len(prompts))), size):
            chunk_params = shared if shared is not None else [params[i] for i in chunk]
            outputs = llm.generate([prompts[i] for i in chunk], chunk_params, use_tqdm=False)
            for i, out in zip(chunk, outputs):
                generated[line_nos[i]] = list(out.outputs[0].token_ids)
        return prompt_tokens, sum(len(ids) for ids in generated.values()), generated

    def stage(rows: int | None = None) -> RunResult:
        todo = first_turns(io.chat_data, index)[:rows]
        counts: dict[str, int] = {"prompt_tokens": 0, "generated_tokens": 0}
        generated: dict[int, list[int]] = {}
        for batch in batches(todo, B):
            for key, value in answer_batch(llm, template, p, batch).items():
                counts[key] = counts.get(key, 0) + value
            for conv in batch:
                generated[conv.line_no] = conv.messages[-1]["regenerated_ids"]["generated"]
        return counts["prompt_tokens"], counts["generated_tokens"], generated

    try:
        warm = min(WARM_UP, len(prompts))
        llm.generate(prompts[:warm], params[:warm], use_tqdm=False)
        stage(warm)
        methods: dict[str, Callable[[], RunResult]] = {
            "plain": lambda: plain(len(prompts)),
            f"plain in batches of {B}": lambda: plain(B),
            "stage": stage,
        }
        results: dict[str, RunResult] = {}  # each method's last run

        def keeping(name: str, method: Callable[[], RunResult]) -> Callable[[], None]:
            return lambda: results.__setitem__(name, method())

        runs = {name: keeping(name, method) for name, method in methods.items()}
        best = timed_passes(runs, args.passes, llm.reset_prefix_cache)
    finally:
        engine.close_llm(llm)

    # the stage's host work outside the engine, on the answers it gave (one run, no engine)
    start = time.monotonic()
    texts = [
        template.render(c.plan[: c.plan.index(None)], c.tools, generation_prompt=True)
        for c in convs
    ]
    for text in texts:
        template.encode(text)
    render_s = time.monotonic() - start
    start = time.monotonic()
    for conv in convs:
        SamplingParams(
            temperature=p.temperature,
            top_p=p.top_p,
            max_tokens=p.max_new_tokens_per_turn,
            seed=turn_seed(p.seed, conv.line_no, 0),
            stop_token_ids=template.stop_ids,
            detokenize=False,
        )
    params_s = time.monotonic() - start
    stage_ids = results["stage"][2]
    start = time.monotonic()
    for conv, text in zip(convs, texts):
        template.answer_message(text, stage_ids[conv.line_no])
    answers_s = time.monotonic() - start

    plain_rate = results["plain"][1] / best["plain"]
    rows: dict[str, dict[str, Any]] = {}
    print(
        f"{'method':24s} {'prompts':>8s} {'prompt tok':>11s} {'gen tok':>9s} {'seconds':>8s} "
        f"{'gen tok/s':>10s} {'/ plain':>8s}"
    )
    for name, (n_prompt, n_gen, _) in results.items():
        rate = n_gen / best[name]
        rows[name] = {
            "prompts": len(prompts),
            "prompt_tokens": n_prompt,
            "generated_tokens": n_gen,
            "seconds": best[name],
            "generated_tokens_per_s": rate,
            "ratio_to_plain": rate / plain_rate,
        }
        print(
            f"{name:24s} {len(prompts):8d} {n_prompt:11d} {n_gen:9d} {best[name]:8.2f} "
            f"{rate:10.1f} {rate / plain_rate:8.3f}"
        )
    ratio = rows["stage"]["ratio_to_plain"]
    batched = rows[f"plain in batches of {B}"]["ratio_to_plain"]
    verdict = "met" if ratio >= TARGET else "NOT met"
    print(
        f"stage / plain: {ratio:.3f} (target >= {TARGET}: {verdict})"
        f"; of which batching (plain in batches of {B} / plain) {batched:.3f}, and the stage's own "
        f"work (stage / plain in batches) {ratio / batched:.3f}"
    )
    host_s = render_s + params_s + answers_s
    print(
        f"stage host work outside the engine, measured apart: render + encode {render_s:.3f} s, "
        f"SamplingParams {params_s:.3f} s, answers decoded and split {answers_s:.3f} s; "
        f"{host_s:.3f} s, {host_s / best['stage']:.1%} of the stage's {best['stage']:.2f} s"
    )
    plain_ids = results["plain"][2]
    stage_diff = differing(plain_ids, stage_ids)
    batched_diff = differing(plain_ids, results[f"plain in batches of {B}"][2])
    greedy = p.temperature == 0
    print(
        f"generated ids {'(greedy)' if greedy else '(sampled: differences expected)'}: stage "
        f"{'identical to' if stage_diff == 0 else 'NOT identical to'} plain, {stage_diff} of "
        f"{len(plain_ids)} conversations differ; plain in batches: {batched_diff} differ"
    )
    if args.json:
        result = {
            "verifier": str(args.verifier),
            "chat_data": str(args.chat_data),
            "conversations": len(convs),
            "batch_size_samples": B,
            "temperature": p.temperature,
            "max_new_tokens_per_turn": p.max_new_tokens_per_turn,
            "methods": rows,
            "stage_ratio": ratio,
            "target": TARGET,
            "host_seconds": {"render": render_s, "sampling_params": params_s, "answers": answers_s},
            "differing_stage": stage_diff,
            "differing_plain_in_batches": batched_diff,
        }
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
