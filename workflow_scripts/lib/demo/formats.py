"""The chat formats of the demo verifiers: special tokens, chat template and stop tokens.

* ``LLAMA3``: Llama-3 headers and <|eot_id|>; the template renders history stably (the
  embedded default, ``demo.corpus: rules`` and ``package_docs``).
* ``QWEN3``: a Qwen3-style hybrid-thinking template (``demo.corpus: reasoning_tools``): ChatML
  turns; an assistant turn after the last user message writes its reasoning in
  ``<think>\\n...\\n</think>\\n\\n`` (the last turn always, empty when it has none), earlier
  turns lose theirs; a tools list in the system turn, tool calls as JSON in <tool_call> tags,
  tool results merged into one user turn of <tool_response> blocks; ``enable_thinking: false``
  closes an empty block in the generation prompt. It rewrites history as Qwen3's does, so the
  workflow's tests train and serve a verifier whose data needs more than one row per conversation.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ChatFormat:
    name: str
    template: str
    special_tokens: list[str]
    bos: str | None
    eos: str  # the tokenizer's eos
    pad: str
    stops: list[str]  # generation_config.json eos_token_id: the tokens that end a generation


LLAMA3 = ChatFormat(
    name="llama3",
    template=(
        "{{- bos_token }}"
        "{%- for message in messages %}"
        "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' "
        "+ message['content'] | trim + '<|eot_id|>' }}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}"
        "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
        "{%- endif %}"
    ),
    special_tokens=[
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eot_id|>",
    ],
    bos="<|begin_of_text|>",
    eos="<|eot_id|>",
    pad="<|end_of_text|>",
    stops=["<|eot_id|>", "<|end_of_text|>"],
)

QWEN3 = ChatFormat(
    name="qwen3",
    template=(
        "{%- set ns = namespace(last_query=messages | length - 1) -%}"
        "{%- for m in messages -%}{%- if m.role == 'user' -%}"
        "{%- set ns.last_query = loop.index0 -%}{%- endif -%}{%- endfor -%}"
        "{%- set system = messages[0].content if messages and messages[0].role == 'system' "
        "else '' -%}"
        "{%- if tools -%}"
        "{{- '<|im_start|>system\\n' + (system + '\\n\\n' if system else '') -}}"
        "{{- 'Tools you may call, one JSON object per call in <tool_call> tags:\\n<tools>' -}}"
        "{%- for t in tools -%}{{- '\\n' + (t | tojson) -}}{%- endfor -%}"
        "{{- '\\n</tools><|im_end|>\\n' -}}"
        "{%- elif system -%}{{- '<|im_start|>system\\n' + system + '<|im_end|>\\n' -}}{%- endif -%}"
        "{%- for m in messages -%}"
        "{%- if m.role == 'user' -%}{{- '<|im_start|>user\\n' + m.content + '<|im_end|>\\n' -}}"
        "{%- elif m.role == 'assistant' -%}"
        "{%- set r = m.reasoning_content if m.reasoning_content is string else '' -%}"
        "{{- '<|im_start|>assistant\\n' -}}"
        "{%- if loop.index0 > ns.last_query and (loop.last or r) -%}"
        "{{- '<think>\\n' + r.strip('\\n') + '\\n</think>\\n\\n' -}}{%- endif -%}"
        "{{- m.content -}}"
        "{%- for c in m.tool_calls or [] -%}"
        "{%- set f = c.function if c.function is defined else c -%}"
        "{%- set a = f.arguments if f.arguments is string else f.arguments | tojson -%}"
        "{{- ('\\n' if (m.content or not loop.first) else '') + '<tool_call>\\n{\"name\": \"' "
        "+ f.name + '\", \"arguments\": ' + a + '}\\n</tool_call>' -}}"
        "{%- endfor -%}"
        "{{- '<|im_end|>\\n' -}}"
        "{%- elif m.role == 'tool' -%}"
        "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}"
        "{{- '<|im_start|>user' -}}{%- endif -%}"
        "{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' -}}"
        "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}"
        "{{- '<|im_end|>\\n' -}}{%- endif -%}"
        "{%- endif -%}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
        "{%- if enable_thinking is defined and enable_thinking is false -%}"
        "{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}{%- endif -%}"
    ),
    special_tokens=[
        "<|endoftext|>",
        "<|im_start|>",
        "<|im_end|>",
        "<think>",
        "</think>",
        "<tool_call>",
        "</tool_call>",
        "<tool_response>",
        "</tool_response>",
    ],
    bos=None,
    eos="<|im_end|>",
    pad="<|endoftext|>",
    stops=["<|im_end|>", "<|endoftext|>"],
)

FORMATS = {"rules": LLAMA3, "package_docs": LLAMA3, "reasoning_tools": QWEN3, "long_docs": LLAMA3}


def format_of(tokenizer) -> ChatFormat:
    """The format whose chat template a demo tokenizer carries."""
    for fmt in (LLAMA3, QWEN3):
        if tokenizer.chat_template == fmt.template:
            return fmt
    raise ValueError("not a demo tokenizer: its chat template is none of demo/formats.py's")
