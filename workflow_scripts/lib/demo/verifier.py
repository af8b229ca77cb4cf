"""The embedded default's verifier: a byte-level BPE tokenizer with the special tokens and chat
template of a chat format (``formats``: Llama-3 for the embedded default), and a small
``LlamaForCausalLM`` trained on the assistant tokens of the generated conversations (the rows and
mask ``prepare`` builds), checked by greedy generation on the held-out prompts and written as a
Hugging Face model directory.

torch and transformers are imported by the functions that need them.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import time
from collections import Counter
from pathlib import Path
from typing import Iterator

from workflow_scripts.lib.chat.template import ChatTemplate
from workflow_scripts.lib.common import (
    UserError,
    atomic_path,
    format_seconds,
    write_json,
)
from workflow_scripts.lib.demo.conversations import dumps_jsonl
from workflow_scripts.lib.demo.formats import LLAMA3, ChatFormat, format_of

log = logging.getLogger("eagle3")

# the embedded default's format; formats.py has the others
SPECIAL_TOKENS = LLAMA3.special_tokens
CHAT_TEMPLATE = LLAMA3.template

# Llama 3's pre-tokenization: words with one leading non-letter, digits in groups of up to three,
# runs of punctuation, newlines kept together.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

PACK_ROW_TOKENS = 256  # conversations are packed into rows of at least this many tokens
WARMUP_FRACTION = 0.05
MIN_LR_RATIO = 0.05
WEIGHT_DECAY = 0.1  # helps the small model find the general rules sooner
ADAM_BETAS = (0.9, 0.95)
GRAD_CLIP_NORM = 1.0
LOG_INTERVAL_S = 5.0
EVAL_MAX_NEW_TOKENS = 96
EVAL_BATCH_PROMPTS = 64


# --------------------------------------------------------------------------- tokenizer


def build_tokenizer(
    rows: list[dict], vocab_size: int, fmt: ChatFormat = LLAMA3, max_length: int = 2048
):
    """A byte-level BPE tokenizer trained on the conversations, as a transformers fast
    tokenizer with the special tokens of ``fmt`` (appended after the learnt vocabulary) and its
    template."""
    from tokenizers import (
        Regex,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(fmt.special_tokens),
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )

    def texts():
        for row in rows:
            for msg in row["messages"]:
                yield f"{msg['role']}\n\n{msg['content']}"
                for key in ("reasoning_content", "tool_calls"):  # reasoning_tools rows
                    if msg.get(key):
                        yield msg[key] if isinstance(msg[key], str) else json.dumps(msg[key])
            if row.get("tools"):
                yield json.dumps(row["tools"])

    tok.train_from_iterator(texts(), trainer)
    tok.add_special_tokens(fmt.special_tokens)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=fmt.bos,
        eos_token=fmt.eos,
        pad_token=fmt.pad,
        add_bos_token=False,
        model_max_length=max_length,  # the verifier's max_position_embeddings
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = fmt.template
    return fast


def save_tokenizer(tokenizer, out_dir: Path) -> None:
    """Saves the tokenizer with its chat template inside tokenizer_config.json (the place every
    loader looks), not in a separate file."""
    tokenizer.save_pretrained(out_dir)
    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = tokenizer.chat_template
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    jinja = out_dir / "chat_template.jinja"
    if jinja.exists():
        jinja.unlink()


# --------------------------------------------------------------------------- training data


def encode_conversation(template: ChatTemplate, row: dict) -> list[tuple[list[int], list[int]]]:
    """(input_ids, loss_mask) of each row of a conversation: the rows and mask ``prepare``
    builds (one row where the template renders history stably, as the embedded default's)."""
    from workflow_scripts.lib.chat.tokenization import read_conversation, tokenize_rows

    rows, _ = tokenize_rows(template, read_conversation(row), 1 << 30)
    limit = template.tokenizer.model_max_length
    if max(len(r.input_ids) for r in rows) > limit:
        raise UserError(
            f"demo conversation {row['id']} has {max(len(r.input_ids) for r in rows)} tokens, "
            f"past the verifier's maximum length (demo.max_position_embeddings {limit}): raise "
            "it, or make the conversations shorter"
        )
    return [(r.input_ids, r.loss_mask) for r in rows]


def pack_batch(
    samples: list[tuple[list[int], list[int]]], pad_id: int, prompt_loss_weight: float = 0.0
):
    """Packs conversations into rows (first fit, longest first) of at least PACK_ROW_TOKENS
    tokens. Positions restart at 0 for every conversation, which makes transformers attend only
    within each conversation. Returns input_ids, position_ids and the loss weight of each
    token as a target: 1 for assistant tokens, ``prompt_loss_weight`` for the rest, 0 for padding
    and for the first token of each conversation."""
    import torch

    row_len = max(PACK_ROW_TOKENS, max(len(ids) for ids, _ in samples))
    rows: list[list[tuple[list[int], list[int]]]] = []
    fill: list[int] = []
    for ids, mask in sorted(samples, key=lambda s: -len(s[0])):
        for r, used in enumerate(fill):
            if used + len(ids) <= row_len:
                rows[r].append((ids, mask))
                fill[r] += len(ids)
                break
        else:
            rows.append([(ids, mask)])
            fill.append(len(ids))
    width = max(fill)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    weights = torch.zeros((len(rows), width), dtype=torch.float32)
    position_ids = torch.zeros((len(rows), width), dtype=torch.long)
    for r, row in enumerate(rows):
        at = 0
        for ids, mask in row:
            n = len(ids)
            input_ids[r, at : at + n] = torch.tensor(ids)
            w = torch.tensor(mask, dtype=torch.float32)
            weights[r, at : at + n] = w + (1 - w) * prompt_loss_weight
            weights[r, at] = 0.0
            position_ids[r, at : at + n] = torch.arange(n)
            at += n
        # the padding is a sequence of its own (positions restart), so nothing attends to it
        position_ids[r, at:] = torch.arange(width - at)
    return input_ids, position_ids, weights


# --------------------------------------------------------------------------- model


def make_config(p, tokenizer, fmt: ChatFormat = LLAMA3):
    from transformers import LlamaConfig

    ids = tokenizer.convert_tokens_to_ids
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=p.hidden_size,
        intermediate_size=p.intermediate_size,
        num_hidden_layers=p.num_hidden_layers,
        num_attention_heads=p.num_attention_heads,
        num_key_value_heads=p.num_key_value_heads,
        max_position_embeddings=p.max_position_embeddings,
        tie_word_embeddings=False,
        bos_token_id=ids(fmt.bos) if fmt.bos else None,
        eos_token_id=[ids(t) for t in fmt.stops],
        pad_token_id=ids(fmt.pad),
        architectures=["LlamaForCausalLM"],
    )


def learning_rate(step: int, total: int, peak: float) -> float:
    """Linear warm-up, then cosine decay to MIN_LR_RATIO x peak."""
    warmup = max(1, int(total * WARMUP_FRACTION))
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (MIN_LR_RATIO + (1 - MIN_LR_RATIO) * 0.5 * (1 + math.cos(math.pi * progress)))


def train_verifier(p, tokenizer, conversations: Iterator[dict]):
    """Trains the verifier on train_steps batches of train_batch_size_samples conversations,
    taken in order from ``conversations``; returns the model and a report."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(p.seed)
    model = LlamaForCausalLM(make_config(p, tokenizer, format_of(tokenizer))).float()
    template = ChatTemplate(tokenizer)
    model.config.use_cache = False
    model.train()
    n_params = sum(t.numel() for t in model.parameters())
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=p.learning_rate,
        weight_decay=WEIGHT_DECAY,
        betas=ADAM_BETAS,
        fused=True,  # one kernel for all tensors: a step of the optimizer is 4x faster on CPU
    )
    pad_id = tokenizer.pad_token_id
    batch = p.train_batch_size_samples
    log.info(
        "demo: training the verifier (%d parameters) for %d steps, %d conversations per step, "
        "peak lr %g",
        n_params,
        p.train_steps,
        batch,
        p.learning_rate,
    )
    curve_every = max(1, p.train_steps // 20)  # the loss curve kept in the report
    start = last_log = time.monotonic()
    log_loss = log_count = curve_loss = curve_count = 0.0
    tokens = assistant_tokens = 0
    losses = []
    for step in range(p.train_steps):
        samples = [
            sample
            for row in itertools.islice(conversations, batch)
            for sample in encode_conversation(template, row)
        ]
        tokens += sum(len(ids) for ids, _ in samples)
        assistant_tokens += sum(sum(mask) for _, mask in samples)
        input_ids, position_ids, weights = pack_batch(samples, pad_id, p.prompt_loss_weight)
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, p.train_steps, p.learning_rate)
        logits = model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits
        per_token = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]),
            input_ids[:, 1:].reshape(-1),
            reduction="none",
        )
        w = weights[:, 1:].reshape(-1)
        loss = (per_token * w).sum() / w.sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP_NORM)
        optimizer.step()
        value = loss.item()
        log_loss, log_count = log_loss + value, log_count + 1
        curve_loss, curve_count = curve_loss + value, curve_count + 1
        now = time.monotonic()
        done = step + 1
        if done == 1 or done == p.train_steps or now - last_log >= LOG_INTERVAL_S:
            elapsed = now - start
            rate = done / elapsed
            log.info(
                "demo: step %d/%d (%.1f%%), loss %.4f, lr %.2e, %.2f steps/s, %.0f tokens/s, "
                "ETA %s, elapsed %s",
                done,
                p.train_steps,
                100 * done / p.train_steps,
                log_loss / log_count,
                optimizer.param_groups[0]["lr"],
                rate,
                tokens / elapsed,
                format_seconds((p.train_steps - done) / rate),
                format_seconds(elapsed),
            )
            last_log = now
            log_loss = log_count = 0.0
        if done % curve_every == 0 or done == p.train_steps:
            losses.append({"step": done, "loss": round(curve_loss / curve_count, 6)})
            curve_loss = curve_count = 0.0
    model.eval()
    log.info(
        "demo: trained in %s on %d conversations, %d tokens (%d assistant tokens)",
        format_seconds(time.monotonic() - start),
        p.train_steps * batch,
        tokens,
        assistant_tokens,
    )
    # no timings here: the same seed gives the same report, byte for byte
    return model, {
        "parameters": n_params,
        "conversations": p.train_steps * batch,
        "tokens": tokens,
        "assistant_tokens": assistant_tokens,
        "final_loss": losses[-1]["loss"],
        "loss_curve": losses,
    }


# --------------------------------------------------------------------------- evaluation


def greedy_answers(model, tokenizer, prompts: list[list[dict]], max_new_tokens: int) -> list[str]:
    """Greedy answers of a transformers model, batched with left padding."""
    import torch

    answers = []
    template = ChatTemplate(tokenizer)
    pad = tokenizer.pad_token_id
    stop = tokenizer.convert_tokens_to_ids(format_of(tokenizer).stops)
    for at in range(0, len(prompts), EVAL_BATCH_PROMPTS):
        encoded = [template.prompt_ids(m) for m in prompts[at : at + EVAL_BATCH_PROMPTS]]
        width = max(len(ids) for ids in encoded)
        input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in encoded])
        attention = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in encoded])
        with torch.no_grad():
            out = model.generate(
                input_ids=input_ids,
                attention_mask=attention,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=stop,
                pad_token_id=pad,
            )
        for row in out[:, width:].tolist():
            ids = row[: next((i for i, t in enumerate(row) if t in stop), len(row))]
            text = tokenizer.decode(ids, skip_special_tokens=False)
            answers.append(text.rpartition("</think>")[2].strip())  # the answer, not its reasoning
    return answers


def held_out_loss(model, tokenizer, eval_rows: list[dict]) -> dict:
    """Teacher-forced cross-entropy (nats per token) and top-1 accuracy of the verifier on the
    held-out references, as answers to their prompts."""
    import torch

    template = ChatTemplate(tokenizer)
    samples = [
        sample
        for r in eval_rows
        for sample in encode_conversation(
            template,
            {
                "id": r["id"],
                "messages": r["messages"] + [{"role": "assistant", "content": r["reference"]}],
            },
        )
    ]
    input_ids, position_ids, weights = pack_batch(samples, tokenizer.pad_token_id)
    with torch.no_grad():
        logits = model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits
    targets = input_ids[:, 1:]
    per_token = torch.nn.functional.cross_entropy(
        logits[:, :-1].transpose(1, 2), targets, reduction="none"
    )
    w = (weights[:, 1:] == 1).float()
    right = (logits[:, :-1].argmax(-1) == targets).float()
    return {
        "held_out_loss": round(float((per_token * w).sum() / w.sum()), 4),
        "held_out_top1": round(float((right * w).sum() / w.sum()), 4),
        "held_out_tokens": int(w.sum()),
    }


def evaluate(model, tokenizer, eval_rows: list[dict]) -> dict:
    # an answer longer than its reference (and the end of turn) cannot be right
    longest = max(
        len(tokenizer(r["reference"], add_special_tokens=False)["input_ids"]) for r in eval_rows
    )
    answers = greedy_answers(
        model, tokenizer, [r["messages"] for r in eval_rows], min(EVAL_MAX_NEW_TOKENS, longest + 2)
    )
    right: Counter[str] = Counter()
    total: Counter[str] = Counter()
    wrong = []
    for row, answer in zip(eval_rows, answers):
        total[row["family"]] += 1
        if answer == row["reference"]:
            right[row["family"]] += 1
        elif len(wrong) < 10:
            wrong.append(
                {
                    "prompt": row["messages"][-1]["content"],
                    "answer": answer,
                    "reference": row["reference"],
                }
            )
    return {
        "held_out_prompts": len(eval_rows),
        **held_out_loss(model, tokenizer, eval_rows),
        "exact_match": sum(right.values()) / max(1, len(eval_rows)),
        "exact_match_by_family": {f: right[f] / total[f] for f in sorted(total)},
        "examples_wrong": wrong,
    }


# --------------------------------------------------------------------------- outputs


def write_verifier(model, tokenizer, out_dir: Path, report: dict) -> None:
    """Writes the verifier directory under a temporary sibling name, then renames it."""
    from transformers import GenerationConfig
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    with atomic_path(out_dir) as tmp:
        model.config.use_cache = True
        model.save_pretrained(tmp, safe_serialization=True)
        # older readers look for torch_dtype, newer ones for dtype
        config = json.loads((tmp / "config.json").read_text())
        config["torch_dtype"] = "float32"
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        GenerationConfig(
            bos_token_id=model.config.bos_token_id,
            eos_token_id=model.config.eos_token_id,
            pad_token_id=model.config.pad_token_id,
        ).save_pretrained(tmp)
        save_tokenizer(tokenizer, tmp)
        write_json(tmp / "demo_report.json", report)
        for path in tmp.iterdir():
            path.chmod(0o644)


def write_jsonl(path: Path, rows: list[dict]) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(dumps_jsonl(rows), encoding="utf-8")
