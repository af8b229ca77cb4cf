"""``demo.corpus: reasoning_tools``: the rule-based tasks of ``conversations`` as a reasoning and
tool-calling verifier writes them. Every assistant turn reasons first (``reasoning_content``);
most capital questions are answered through a tool, ``lookup_capital``: the assistant calls it
(reasoning, then the call), the tool returns the capital, the assistant reasons on the result and
answers. Rows with a tool call carry the ``tools`` list. Made for the Qwen3-style demo format
(``formats.QWEN3``), whose template rewrites history: these are the data the workflow's
tests train on and serve with reasoning and tool calls.
"""

from __future__ import annotations

import itertools
import json
import random
from typing import Iterator

from workflow_scripts.lib.demo.conversations import (
    CAPITALS,
    SYSTEM_PROMPTS,
    Task,
    generate_eval_prompts,
    sample_task,
)

TOOL = "lookup_capital"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": TOOL,
            "description": "The capital city of a country, and what the city is famous for.",
            "parameters": {
                "type": "object",
                "properties": {"country": {"type": "string", "description": "The country."}},
                "required": ["country"],
            },
        },
    }
]
TOOL_SHARE = 0.8  # of the capital questions, answered through the tool
HOW = {
    "count": "I count up one number at a time and stop where I was asked to.",
    "letters": "I go through the alphabet one letter at a time.",
    "spell": "I spell the word one letter at a time.",
    "times": "I multiply the two numbers.",
    "animal": "I recall what this animal is like.",
    "colour": "I recall the colour of this thing.",
    "capital": "I recall the capital of this country.",
    "days": "I go through the days of the week in order.",
    "months": "I go through the months of the year in order.",
    "story": "I keep the names and tell the story in order.",
}


def reasoning(task: Task) -> str:
    return f"The user asks: {task.user} This is a {task.family} task. {HOW[task.family]}"


def tool_turns(task: Task, call_id: str) -> list[dict]:
    """A capital question answered through the tool: the call, its result, the answer."""
    country = next(c for c in sorted(CAPITALS, key=len, reverse=True) if c in task.user)
    capital, known_for = CAPITALS[country]
    result = {"country": country, "capital": capital, "famous_for": known_for}
    return [
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": f"The user asks: {task.user} I look it up with {TOOL}.",
            "tool_calls": [
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": TOOL, "arguments": {"country": country}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call_id, "name": TOOL, "content": json.dumps(result)},
        {
            "role": "assistant",
            "content": task.answer,
            "reasoning_content": f"{TOOL} says the capital of {country} is {capital}.",
        },
    ]


def iter_conversations(seed: int) -> Iterator[dict]:
    """Training conversations without end: a system message and one to three exchanges."""
    rng = random.Random(f"eagle3-demo-reasoning-tools-{seed}")
    for idx in itertools.count():
        messages = [{"role": "system", "content": rng.choice(SYSTEM_PROMPTS)}]
        calls = 0
        for _ in range(rng.choice([1, 2, 2, 3])):
            task = sample_task(rng, held_out=False)
            messages.append({"role": "user", "content": task.user})
            if task.family == "capital" and rng.random() < TOOL_SHARE:
                messages += tool_turns(task, f"call_{idx}_{calls}")
                calls += 1
            else:
                messages.append(
                    {
                        "role": "assistant",
                        "content": task.answer,
                        "reasoning_content": reasoning(task),
                    }
                )
        row = {"id": f"demo-rt-{seed}-{idx:06d}", "messages": messages}
        yield {**row, "tools": TOOLS} if calls else row


def generate_conversations(seed: int, num: int) -> list[dict]:
    """The first ``num`` conversations of ``iter_conversations(seed)``."""
    return list(itertools.islice(iter_conversations(seed), num))


__all__ = ["TOOLS", "generate_conversations", "generate_eval_prompts", "iter_conversations"]
