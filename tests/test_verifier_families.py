"""Verifiers as they ship, read without loading them whole (lib/verifier/files.py), and their heads
computed as each family computes them (lib/draft/teacher_head.py): multimodal wrappers (text_config,
language_model. tensor prefixes), quantized checkpoints whose experts are INT4 and whose embedding
and head stay in floating point, a head that is itself quantized refused; Gemma's offset norm,
soft-capped and scaled logits, against transformers' own models."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from workflow_scripts.lib.common import UserError
from workflow_scripts.lib.draft.teacher_head import HeadSpec, TeacherHead
from workflow_scripts.lib.verifier.files import locate_tensors, read_tensor, verifier_config

V, H = 64, 16
TEXT = {"hidden_size": H, "num_hidden_layers": 4, "vocab_size": V, "model_type": "deepseek_v3"}


def checkpoint(path: Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(path / "model.safetensors"))
    return path


def floats(*shape):
    return torch.randn(*shape)


@pytest.mark.parametrize(
    "layout",
    [
        {  # Kimi-K2.5 style: the language model under language_model.
            "language_model.model.embed_tokens.weight": floats(V, H),
            "language_model.model.norm.weight": floats(H),
            "language_model.lm_head.weight": floats(V, H),
            "vision_tower.encoder.blocks.0.norm.weight": floats(8),
            "mm_projector.proj.0.weight": floats(H, 8),
        },
        {  # Qwen3-VL style: model.language_model. and model.visual., lm_head at the top
            "model.language_model.embed_tokens.weight": floats(V, H),
            "model.language_model.norm.weight": floats(H),
            "lm_head.weight": floats(V, H),
            "model.visual.blocks.0.norm1.weight": floats(8),
            "model.visual.merger.norm.weight": floats(8),
        },
    ],
    ids=["kimi_k25", "qwen3_vl"],
)
def test_multimodal_wrappers_are_read_through_their_language_model(tmp_path, layout):
    config = {"architectures": ["SomeWrapperForConditionalGeneration"], "text_config": TEXT}
    path = checkpoint(tmp_path / "v", config, layout)
    vcfg = verifier_config(path)
    assert vcfg["hidden_size"] == H and vcfg["architectures"] == config["architectures"]
    found = locate_tensors(path, vcfg)
    names = {k: name for k, (_, name) in found.items()}
    assert "vision" not in names["norm"] and "visual" not in names["norm"]
    assert torch.equal(
        read_tensor(found["lm_head"]),
        next(v for k, v in layout.items() if k.endswith("lm_head.weight")),
    )


def test_int4_experts_are_fine_the_embedding_and_head_read_in_floating_point(tmp_path):
    """compressed-tensors INT4 experts (as Kimi-K2.5 ships) beside a floating-point embedding
    and head: the draft reads only those."""
    tensors = {
        "model.embed_tokens.weight": floats(V, H).to(torch.bfloat16),
        "model.norm.weight": floats(H).to(torch.bfloat16),
        "lm_head.weight": floats(V, H).to(torch.bfloat16),
        "model.layers.1.mlp.experts.0.gate_proj.weight_packed": torch.zeros(
            32, 2, dtype=torch.int32
        ),
        "model.layers.1.mlp.experts.0.gate_proj.weight_scale": floats(32, 1).to(torch.bfloat16),
    }
    path = checkpoint(
        tmp_path / "v",
        {**TEXT, "quantization_config": {"quant_method": "compressed-tensors"}},
        tensors,
    )
    found = locate_tensors(path, verifier_config(path))
    assert read_tensor(found["lm_head"]).dtype == torch.bfloat16


@pytest.mark.parametrize(
    "head",
    [
        {
            "lm_head.weight_packed": torch.zeros(V, 2, dtype=torch.int32),
            "lm_head.weight_scale": floats(V, 1),
        },
        {"lm_head.weight": torch.zeros(V, H, dtype=torch.int8)},
    ],
    ids=["packed", "int8"],
)
def test_a_quantized_head_is_a_clear_error(tmp_path, head):
    tensors = {"model.embed_tokens.weight": floats(V, H), "model.norm.weight": floats(H), **head}
    path = checkpoint(tmp_path / "v", {**TEXT, "tie_word_embeddings": False}, tensors)
    with pytest.raises(UserError, match="quantized|floating point"):
        locate_tensors(path, verifier_config(path))


def hf_head_matches_teacher(model, vcfg: dict) -> None:
    """The teacher (final norm + lm_head with the family's HeadSpec) on the last layer's output
    before the final norm equals the model's own logits."""
    torch.manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (1, 12))
    captured = {}
    base = model.get_decoder()
    base.norm.register_forward_pre_hook(lambda _m, args: captured.setdefault("h", args[0]))
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0]
    head = model.lm_head.weight
    teacher = TeacherHead(
        base.norm.weight, head, model.config.rms_norm_eps, head, spec=HeadSpec.of(vcfg)
    )
    torch.testing.assert_close(
        teacher.full_logits(captured["h"][0]), logits.float(), atol=1e-4, rtol=1e-4
    )


def test_gemma_offset_norm_and_soft_capped_logits_are_the_models():
    from transformers import Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig

    small = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=2, num_key_value_heads=1, head_dim=16)  # fmt: skip
    for cfg, cls in (
        (Gemma3TextConfig(**small), Gemma3ForCausalLM),
        (Gemma2Config(**small, final_logit_softcapping=5.0), Gemma2ForCausalLM),
    ):
        model = cls(cfg).eval()
        with torch.no_grad():  # a norm weight far from zero, so the offset shows
            model.model.norm.weight.normal_(0, 1)
        vcfg = cfg.to_dict()
        assert HeadSpec.of(vcfg).norm_offset == 1.0
        hf_head_matches_teacher(model, vcfg)
        wrong = TeacherHead(
            model.model.norm.weight, model.lm_head.weight, cfg.rms_norm_eps, model.lm_head.weight
        )
        assert wrong.spec.norm_offset == 0.0  # the plain teacher: what the teacher check catches


def test_scaled_logits_are_the_models():
    from transformers import GraniteConfig, GraniteForCausalLM

    small = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
    cfg = GraniteConfig(**small, logits_scaling=4.0)
    hf_head_matches_teacher(GraniteForCausalLM(cfg).eval(), cfg.to_dict())


# what the installed vLLM's registry says of each family (docs/verifier-families.md's table),
# asked as the dry-run asks it: a child process, no weights
REGISTRY = {
    "LlamaForCausalLM": True,
    "MistralForCausalLM": True,
    "Qwen3ForCausalLM": True,
    "Qwen3MoeForCausalLM": True,
    "GptOssForCausalLM": True,
    "DeepseekV3ForCausalLM": True,
    "KimiK25ForConditionalGeneration": True,
    "Gemma3ForCausalLM": False,
    "Gemma2ForCausalLM": False,
    "Glm4MoeForCausalLM": False,
    "CohereForCausalLM": False,
}


@pytest.mark.engine
def test_the_registry_says_which_families_have_eagle3_states():
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "workflow_scripts.lib.verifier.vllm_support", *REGISTRY],
        capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[1],
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    answers = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {arch: a["known"] for arch, a in answers.items()} == dict.fromkeys(REGISTRY, True)
    assert {arch: a["eagle3"] for arch, a in answers.items()} == REGISTRY
