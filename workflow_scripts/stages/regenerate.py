"""regenerate: the verifier answers the user turns of the chat data itself (self-distillation).

Job ``job_index`` of ``regenerate.num_jobs`` answers its share of the batches with real vLLM
(``lib/regeneration/answers.py`` has how answers are written, resumed and fingerprinted).
Malformed rows and first prompts too long for the engine are found in one pass before the model
loads.
"""

from __future__ import annotations

import json
import logging
import time

from workflow_scripts.lib.chat.template import load_template
from workflow_scripts.lib.common import (
    Progress,
    UserError,
    atomic_path,
    format_seconds,
    run_main,
    write_json,
)
from workflow_scripts.lib.regeneration.answers import (
    answer_batch,
    batch_path,
    batch_result,
    clean_work_dir,
    fingerprint,
    index_input,
    make_engine,
    read_conversations,
)
from workflow_scripts.lib.verifier import engine, preflight
from workflow_scripts.lib.verifier import files as verifier_files
from workflow_scripts.lib.workflow import cli
from workflow_scripts.lib.workflow.code_inputs import made_by

log = logging.getLogger("eagle3")


def main() -> None:
    io, p = cli.parse("regenerate")
    if not io.chat_data.is_file():
        raise UserError(f"chat data '{io.chat_data}' does not exist (config key 'chat_data')")
    cfg = verifier_files.verifier_config(io.verifier)
    verifier_files.weight_files(io.verifier)
    dtype = preflight.check_engine(p, "regenerate", cfg)
    template = load_template(io.verifier, p.chat_template)
    stops = template.stop_ids

    log.info("regenerate: checking %s before the model loads", io.chat_data)
    index = index_input(io.chat_data, p, template)
    usable = len(index.offsets)
    if usable == 0:
        raise UserError(
            f"{io.chat_data}: no usable conversation among {index.rows_in} rows "
            f"(bad rows: {dict(index.bad) or 'none'})"
        )
    B = p.batch_size_samples
    num_batches = -(-usable // B)
    if io.job_index >= p.num_jobs:
        raise UserError(f"job index {io.job_index} is not below regenerate.num_jobs {p.num_jobs}")
    expected = fingerprint(io, p, index, dtype)
    mine = list(range(io.job_index, num_batches, p.num_jobs))
    done = set(clean_work_dir(io.work_dir, expected, num_batches, io.job_index, p.num_jobs))
    todo = [b for b in mine if b not in done]
    log.info(
        "regenerate job %d/%d: %d conversations (%d bad rows %s) in %d batches, %d of them this "
        "job's; %d finished earlier, %d to do; stop tokens %s",
        io.job_index, p.num_jobs, usable, sum(index.bad.values()), dict(index.bad), num_batches,
        len(mine), len(done), len(todo), stops,
    )  # fmt: skip

    start = time.monotonic()
    if todo:
        engine.check_devices(p, "regenerate", dtype=dtype, verifier=io.verifier)
        llm = make_engine(io, p, dtype)
        log.info("regenerate: engine ready after %s", format_seconds(time.monotonic() - start))
        todo_rows = sum(min(B, usable - b * B) for b in todo)
        progress = Progress(
            "regenerate", total=todo_rows, interval_s=p.progress_interval_s, unit="conversations"
        )
        progress.update(0, force=True)
        for b in todo:
            rows = range(b * B, min(usable, (b + 1) * B))
            convs = list(read_conversations(io.chat_data, index, rows))
            counts = answer_batch(llm, template, p, convs, progress)
            result = batch_result(p, convs, counts)
            with atomic_path(batch_path(io.work_dir, b)) as tmp:
                tmp.write_text(json.dumps({"fingerprint": expected, **result}, ensure_ascii=False))
            progress.update(len(convs))
        progress.log()
        engine.close_llm(llm)
    else:
        log.info("regenerate: nothing to do: the model is not loaded")
    part = {
        "fingerprint": expected,
        "chat_data": str(io.chat_data),
        "verifier": str(io.verifier),
        "num_jobs": p.num_jobs,
        "job_index": io.job_index,
        "num_batches": num_batches,
        "batches": mine,
        "batches_reused": len(done),
        "rows_in": index.rows_in,
        "bad_rows": dict(sorted(index.bad.items())),
        "seconds": round(time.monotonic() - start, 1),
        "params": p.model_dump(mode="json"),
        "made_by": made_by("regenerate"),
    }
    write_json(io.part, part)
    log.info("regenerate job %d: %d batches -> %s", io.job_index, len(mine), io.part)


if __name__ == "__main__":
    run_main(main)
