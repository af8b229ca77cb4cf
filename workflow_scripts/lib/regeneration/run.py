"""One regenerate job (``regenerate(io, p)``): its share of the batches answered with real vLLM,
the finished ones reused, and the part it writes (lib/regeneration/records.py). Malformed rows and
first prompts too long for the engine are found in one pass before the model loads.
"""

from __future__ import annotations

import logging
import time

from workflow_scripts.lib.chat.template import load_template
from workflow_scripts.lib.common import Progress, UserError, format_seconds
from workflow_scripts.lib.regeneration.answers import (
    answer_batch,
    batch_path,
    batch_result,
    batch_keys,
    clean_work_dir,
    index_input,
    make_engine,
    read_conversations,
)
from workflow_scripts.lib.regeneration.records import RegeneratePart
from workflow_scripts.lib.verifier import engine, preflight
from workflow_scripts.lib.verifier import files as verifier_files
from workflow_scripts.lib.workflow.code_inputs import made_by
from workflow_scripts.lib.workflow.definitions import RegenerateParams
from workflow_scripts.lib.workflow.jobs import job_units
from workflow_scripts.lib.workflow.registry import RegenerateIO

log = logging.getLogger("eagle3")


def regenerate(io: RegenerateIO, p: RegenerateParams) -> RegeneratePart:
    if not io.chat_data.is_file():
        raise UserError(f"chat data '{io.chat_data}' does not exist (config key 'chat_data')")
    cfg = verifier_files.verifier_config(io.verifier)
    verifier_files.weight_files(io.verifier)
    preflight.check_engine(p, "regenerate", cfg)
    dtype = engine.resolve_dtype(p, cfg)
    template = load_template(io.verifier, p.chat_template)

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
    mine = list(job_units(io.job_index, p.num_jobs, num_batches, "regenerate"))
    keys = batch_keys(io, p, index, dtype)
    done = set(clean_work_dir(io.work_dir, keys, io.job_index, p.num_jobs))
    todo = [b for b in mine if b not in done]
    log.info(
        "regenerate job %d/%d: %d conversations (%d bad rows %s) in %d batches, %d of them this "
        "job's; %d finished earlier, %d to do; stop tokens %s",
        io.job_index, p.num_jobs, usable, sum(index.bad.values()), dict(index.bad), num_batches,
        len(mine), len(done), len(todo), template.stop_ids,
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
            batch_result(p, convs, counts, keys[b]).write(batch_path(io.work_dir, b))
            progress.update(len(convs))
        progress.log()
        engine.close_llm(llm)
    else:
        log.info("regenerate: nothing to do: the model is not loaded")
    return RegeneratePart(
        input_sha256=index.sha256,
        batch_keys=keys,
        chat_data=str(io.chat_data),
        verifier=str(io.verifier),
        num_jobs=p.num_jobs,
        job_index=io.job_index,
        num_batches=num_batches,
        batches=mine,
        batches_reused=len(done),
        rows_in=index.rows_in,
        bad_rows=dict(sorted(index.bad.items())),
        seconds=round(time.monotonic() - start, 1),
        params=p.model_dump(mode="json"),
        made_by=made_by("regenerate"),
    )
