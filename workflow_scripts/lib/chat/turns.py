"""Each assistant turn supervised exactly as the verifier generates it, and the fewest rows that
hold every turn so.

A turn (an assistant message j) is the prompt the verifier is served at that point, the template
with its generation prompt over messages[:j], and the tokens it generates after it: reasoning,
answer, tool calls and the stop token that ends the generation, nothing after it (not the
newline after <|im_end|>), never a scaffold the generation prompt holds (a prefilled <think>),
never user text or a tool result. The generated text is the template's own rendering of the turn
as the last message (``messages[:j + 1]``): after the served prompt where the template extends it;
where the template writes the history differently once the turn follows (Kimi, gpt-oss after a
tool call, Mistral's system text), from the same history rendered before a stand-in of the turn;
and where it drops the turn's own reasoning (Kimi's final answers, DeepSeek every turn), with the
reasoning written back as the template writes it elsewhere (``ReasoningFormat``) or, for
templates that never render it, into the <think> block their generation prompt opens. Reasoning
the verifier never writes is a bad row (``reasoning_not_rendered``): where the template renders
none and opens no <think> block (Llama 3.1), and where its generation prompt closes the block
(thinking off: DeepSeek-V3.1 by default, Qwen3 with ``enable_thinking: false``, ...).

Rows: the turns of a conversation share a row while each turn's served prompt extends the row so
far, token for token; a turn whose prompt rewrites the history (Qwen3 drops earlier reasoning
after a new user message) starts a new row. A regenerated conversation carries the ids the
verifier was served and sampled; those are used as they are.

Linear in the turns: a turn's served prompt that extends the previous turn's prompt and
generation as text, after its stop token, is tokenized from there on only, where the tokenizer
starts afresh after that token (``ChatTemplate.fresh_after``); once per row the whole last
prompt is tokenized as well and must give the same ids, else the conversation is tokenized
again turn by turn, whole prompts. Either way a prompt's ids are the tokenizer's for its text.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from workflow_scripts.lib.chat.rows import THINK_CLOSE, THINK_OPEN, BadRow, Conversation
from workflow_scripts.lib.chat.template import ChatTemplate, common_prefix

MARK = "Mzq turn mark"  # a stand-in answer, to find where a turn starts in a render
KINDS = ("reasoning", "answer", "tool_call", "stop", "markup")


@dataclass
class Turn:
    message: int  # the assistant message's index
    prompt_ids: list[int]
    generated_ids: list[int]  # what is supervised: ends with the stop token
    kinds: Counter = field(default_factory=Counter)  # supervised tokens by kind (KINDS)
    # its prompt ids begin with the previous turn's prompt and generated ids, by construction
    extends_previous: bool = False


@dataclass
class Row:
    input_ids: list[int]
    loss_mask: list[int]
    turns: list[int]  # the assistant messages it supervises


def generated_text(
    ct: ChatTemplate, conv: Conversation, j: int, prompt: str, templated: list | None = None
) -> str:
    """What the template writes for assistant message ``j`` after the served ``prompt``
    (``templated``: the conversation's messages as the template reads them, if made)."""
    msgs, tools = conv.messages, conv.tools
    full = ct.render(msgs[: j + 1], tools, templated=templated)
    if full.startswith(prompt):
        return full[len(prompt) :]
    # the history or the turn's start is written differently once the turn follows: find the
    # turn's start in a render of the same history before a stand-in of the same kind
    before = ct.render(msgs[:j], tools)
    header = prompt[common_prefix(prompt, before) :]  # the generation prompt
    stub = {k: v for k, v in msgs[j].items() if k != "reasoning"}
    # a stand-in of the same kind (a template may drop a tool call's text: then a plain one)
    for stand_in in ({**stub, "content": MARK}, {"role": "assistant", "content": MARK}):
        marked = ct.render(msgs[:j] + [stand_in], tools)
        at = marked.rfind(MARK)
        if at < 0:
            continue
        # the generation prompt, or the tokens of it the turn holds (DeepSeek-V3.1 prefills
        # <think> where the turn, once written, has </think>)
        tokens = ct.encode(header)
        for n in range(len(tokens), -1, -1):
            head = ct.decode(tokens[:n])
            start = marked.rfind(head, 0, at) if n else at
            if start >= 0 and full.startswith(marked[:start]):
                return full[start + len(head) :]
    raise BadRow(
        "template_unstable",
        f"message {j}: the chat template writes the conversation before this turn differently "
        "when the turn follows, so where the turn starts cannot be found",
    )


def with_reasoning(ct: ChatTemplate, prompt: str, text: str, reasoning: str, j: int) -> str:
    """``text`` (a turn as the template writes it) with ``reasoning`` where the verifier
    generates it, when the template dropped it from this turn: as the template writes reasoning
    where it keeps it; else in the <think> block the generation prompt opens (DeepSeek-V3.1:
    ``R</think>A``, R1: ``R\n</think>\n\nA``); else, for a tokenizer with <think> tokens, in a
    block of the verifier's own (``<think>\nR\n</think>\n\nA``, R1's layout, as after a
    tool result, where R1's template opens none)."""
    fmt = ct.reasoning
    if fmt is not None and text.startswith(fmt.before + fmt.after):
        rest = text[len(fmt.before + fmt.after) :]
        return fmt.before + fmt.open + reasoning + fmt.close + fmt.after + rest
    opened = prompt.rstrip("\n")
    if opened.endswith(THINK_OPEN):  # the generation prompt opens the block (DeepSeek)
        ws = prompt[len(opened) :]
        if THINK_CLOSE in text:
            at = text.index(THINK_CLOSE)
            return text[:at] + reasoning + ws + text[at:]
        return reasoning + ws + THINK_CLOSE + ws + ws + text.lstrip("\n")
    vocab = ct.tokenizer.get_vocab()
    if THINK_OPEN in vocab and THINK_CLOSE in vocab:  # the verifier opens the block itself
        return f"{THINK_OPEN}\n{reasoning}\n{THINK_CLOSE}\n\n" + text.lstrip("\n")
    raise BadRow(
        "reasoning_not_rendered",
        f"message {j} has reasoning, but the chat template (with the chat_template.kwargs given) "
        "renders none for it and its generation prompt opens no <think> block; drop the "
        "reasoning, or set the template arguments the verifier is served with",
    )


def cut_at_stop(ct: ChatTemplate, ids: list[int], follower: str | None) -> list[int]:
    """``ids`` up to the first stop token, included; where the template writes none (GLM), the
    stop token the verifier generates before the message that follows (by its role)."""
    for i, t in enumerate(ids):
        if t in ct.stop_ids:
            return ids[: i + 1]
    stop = ct.next_role_stop.get(follower or "user")
    if stop is None:
        raise BadRow(
            "no_stop_token",
            "the chat template writes no stop token after the turn (none of the verifier's "
            f"generation_config eos_token_id {ct.stop_ids}), and none follows it",
        )
    return ids + [stop]


def template_turn(ct: ChatTemplate, conv: Conversation, j: int) -> tuple[list[int], str, list[int]]:
    """(served prompt ids, generated text, generated ids) of assistant message ``j``."""
    prompt, text, ids = template_turn_text(ct, conv, j)
    return ct.encode(prompt), text, ids


def template_turn_text(
    ct: ChatTemplate, conv: Conversation, j: int, templated: list | None = None
) -> tuple[str, str, list[int]]:
    """(served prompt, generated text, generated ids) of assistant message ``j``
    (``templated``: the conversation's messages as the template reads them, if made)."""
    prompt = ct.render(conv.messages[:j], conv.tools, generation_prompt=True, templated=templated)
    reasoning = conv.texts(j)["reasoning"]
    # thinking off: the served prompt closes the <think> block, or the template's does after a
    # user message (DeepSeek-V3.1 serves none after a tool result)
    if reasoning and (ct.thinking_off or prompt.rstrip().endswith(THINK_CLOSE)):
        raise BadRow(
            "reasoning_not_rendered",
            f"message {j} has reasoning, but the chat template's generation prompt (with the "
            "chat_template.kwargs given) closes the <think> block, so the verifier writes none; "
            "drop the reasoning, or switch thinking on in chat_template.kwargs (thinking: true "
            "for DeepSeek-V3.1 and Kimi-K2.5, enable_thinking: true for Qwen3 and GLM)",
        )
    text = generated_text(ct, conv, j, prompt, templated)
    if reasoning and reasoning not in text:
        text = with_reasoning(ct, prompt, text, reasoning, j)
    follower = conv.messages[j + 1]["role"] if j + 1 < len(conv.messages) else None
    ids = cut_at_stop(ct, ct.encode(text), follower)
    return prompt, text, ids


def supervised_kinds(ct: ChatTemplate, conv: Conversation, j: int, ids: list[int]) -> Counter:
    """The supervised tokens of a turn by kind; a BadRow if its reasoning, answer or a tool
    call's name is in none of them."""
    texts = conv.texts(j)
    if not (texts["reasoning"] or texts["answer"] or texts["tool_names"]):
        raise BadRow("empty_turn", f"message {j}: an assistant turn with no text or tool call")
    body = ids[:-1] if ids and ids[-1] in ct.stop_ids else ids
    text = ct.decode(body)
    spans: dict[str, tuple[int, int]] = {}
    at = 0
    for kind in ("reasoning", "answer"):
        if texts[kind]:
            start = text.find(texts[kind], at)
            if start < 0:
                raise BadRow(
                    "not_supervised",
                    f"message {j}: its {kind} appears in no supervised token (the chat template "
                    "drops or rewrites it)",
                )
            spans[kind] = (start, start + len(texts[kind]))
            at = start + len(texts[kind])
    for name in texts["tool_names"]:
        if name not in text:
            raise BadRow(
                "not_supervised",
                f"message {j}: its tool call {name!r} appears in no supervised token (the chat "
                "template drops it)",
            )
    kinds: Counter = Counter()
    if len(body) < len(ids):
        kinds["stop"] += 1
    offsets = _offsets(ct, body, text)
    for start, end in offsets:
        kind = next((k for k, (a, b) in spans.items() if start < b and end > a), None)
        if kind is None:
            kind = "tool_call" if texts["tool_names"] and start >= at else "markup"
        kinds[kind] += 1
    return kinds


def _offsets(ct: ChatTemplate, ids: list[int], text: str) -> list[tuple[int, int]]:
    """The character span of each token of ``ids`` in ``text`` (their decoding)."""
    enc = ct.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    if enc["input_ids"] == ids:
        return [tuple(o) for o in enc["offset_mapping"]]
    spans, at = [], 0
    for t in ids:  # tokens sampled otherwise than the text tokenizes: one at a time
        piece = ct.decode([t])
        spans.append((at, at + len(piece)))
        at += len(piece)
    return spans


def conversation_turns(ct: ChatTemplate, conv: Conversation, whole: bool = False) -> list[Turn]:
    """Every assistant turn of ``conv``, as served and generated; regenerated turns from the
    ids recorded with them (``conv.extra['turn_ids']``: message index -> (prompt, sampled)).
    A prompt that extends the turn before is tokenized from where it did (module docstring);
    ``whole``: every prompt whole."""
    recorded: dict[int, Any] = conv.extra.get("turn_ids", {})
    turns: list[Turn] = []
    before: tuple[str, list[int]] | None = None  # the last turn's prompt and generation
    chain_end: tuple[str, list[int]] | None = None  # the last prompt tokenized from a previous
    templated = ct.template_messages(conv.messages)  # once: every render takes the first j
    for j, msg in enumerate(conv.messages):
        if msg["role"] != "assistant":
            continue
        extends = False
        if j in recorded:
            prompt_ids, ids = (list(x) for x in recorded[j])
            before = None
        else:
            prompt, _, ids = template_turn_text(ct, conv, j, templated)
            if before is not None and prompt.startswith(before[0]):
                prompt_ids, extends = before[1] + ct.encode(prompt[len(before[0]) :]), True
                chain_end = prompt, prompt_ids
            else:
                if not _verified(ct, chain_end):
                    return conversation_turns(ct, conv, whole=True)
                prompt_ids, chain_end = ct.encode(prompt), None
            before = None
            if not whole and ids and ids[-1] in ct.fresh_after:
                before = prompt + ct.decode(ids), prompt_ids + ids
        turns.append(Turn(j, prompt_ids, ids, supervised_kinds(ct, conv, j, ids), extends))
    if not _verified(ct, chain_end):
        return conversation_turns(ct, conv, whole=True)
    return turns


def _verified(ct: ChatTemplate, chain_end: tuple[str, list[int]] | None) -> bool:
    """Whether the last prompt of a chain tokenized from the turns before has the ids of its
    whole text (the check that makes the chain's ids the tokenizer's own)."""
    return chain_end is None or ct.encode(chain_end[0]) == chain_end[1]


def pack_rows(turns: list[Turn]) -> list[Row]:
    """The fewest rows that hold every turn exactly: a turn joins the current row when its
    served prompt starts with the row's tokens (the template renders that history unchanged)."""
    rows: list[Row] = []
    for turn in turns:
        row = rows[-1] if rows else None
        if row is not None and (
            turn.extends_previous or turn.prompt_ids[: len(row.input_ids)] == row.input_ids
        ):
            gap = turn.prompt_ids[len(row.input_ids) :]
            row.input_ids += gap + turn.generated_ids
            row.loss_mask += [0] * len(gap) + [1] * len(turn.generated_ids)
            row.turns.append(turn.message)
        else:
            rows.append(
                Row(
                    turn.prompt_ids + turn.generated_ids,
                    [0] * len(turn.prompt_ids) + [1] * len(turn.generated_ids),
                    [turn.message],
                )
            )
    return rows


def unique_tokens(rows: list[Row]) -> int:
    """Tokens the rows of one conversation hold once their shared prefixes are counted once."""
    seen: list[list[int]] = []
    total = 0
    for row in rows:
        shared = max((common_prefix_ids(row.input_ids, s) for s in seen), default=0)
        total += len(row.input_ids) - shared
        seen.append(row.input_ids)
    return total


def common_prefix_ids(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


__all__ = ["KINDS", "Row", "Turn", "common_prefix", "conversation_turns", "pack_rows"]
