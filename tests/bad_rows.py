"""Every kind of bad chat row this project knows, as raw bytes with the reason the stages count
it under, and a tokenizer whose chat template refuses a message (as many real templates do on
roles out of order)."""

from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoTokenizer

TEMPLATE_REFUSES = "refuses"  # a message content that the test template raises on
EVERY_BAD_ROW = [
    (b'{"messages": [{"role": "user", "content": "caf\xe9"}]}', "not_utf8"),
    (b"\xff\xfe{}", "not_utf8"),
    (b"{not json", "malformed"),
    (b"[" * 100_000 + b"]" * 100_000, "malformed"),  # nested too deeply
    (b"[1, 2]", "malformed"),
    (b'"a string"', "malformed"),
    (b"42", "malformed"),
    (b"null", "malformed"),
    (b'{"text": "no messages key"}', "malformed"),
    (b'{"messages": "not a list"}', "malformed"),
    (b'{"messages": {"role": "user"}}', "malformed"),
    (b'{"messages": [["user", "hi"]]}', "malformed"),
    (b'{"messages": [{"role": "user"}]}', "malformed"),
    (b'{"messages": [{"role": "user", "content": null}]}', "malformed"),
    (b'{"messages": [{"role": "user", "content": 7}]}', "malformed"),
    (b'{"conversations": "x"}', "malformed"),
    # a tool call without a function name; arguments that are not a JSON object
    (b'{"messages": [{"role": "assistant", "tool_calls": [{"function": {}}]}]}', "malformed"),
    (
        b'{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": '
        b'[{"function": {"name": "f", "arguments": "{not json"}}]}]}',
        "malformed",
    ),
    (b'{"messages": [{"role": "user", "content": "q"}], "tools": "not a list"}', "malformed"),
    # reasoning both in a field and inline
    (
        b'{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", '
        b'"reasoning_content": "r", "content": "<think>r</think>a"}]}',
        "malformed",
    ),
    # reasoning cut off before its </think> (as at a length limit)
    (
        b'{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", '
        b'"content": "<think>reasoning cut off at the length lim"}]}',
        "unclosed_think",
    ),
    (b'{"messages": []}', "empty_conversation"),
    (b'{"messages": [{"role": "robot", "content": "beep"}]}', "unknown_role"),
    (b'{"messages": [{"role": 5, "content": "beep"}]}', "unknown_role"),
    (b'{"messages": [{"role": "user", "content": "only a question"}]}', "no_assistant_tokens"),
    (
        json.dumps(
            {
                "messages": [
                    {"role": "user", "content": TEMPLATE_REFUSES},
                    {"role": "assistant", "content": "x"},
                ]
            }
        ).encode(),
        "template_error",
    ),
]


def refusing_tokenizer(path: Path, chatml_dir: Path) -> Path:
    """The ChatML tokenizer with a template that raises on a message (as many real templates
    do on roles out of order)."""
    tokenizer = AutoTokenizer.from_pretrained(chatml_dir)
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m['content'] == '" + TEMPLATE_REFUSES + "' %}"
        "{{ raise_exception('this template refuses it') }}{% endif %}{% endfor %}"
        + tokenizer.chat_template
    )
    tokenizer.save_pretrained(path)
    return path
