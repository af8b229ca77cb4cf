"""What prepare keeps of reasoning and tool-calling chat data, per chat-template family.

For each family of tests/chat_families.py (chat templates written from the documented behaviour
of Qwen3, Kimi-K2-Thinking and K2.5, DeepSeek-R1 and V3.1, gpt-oss, Llama-3.1, GLM-4.5 and
Mistral, on a tokenizer holding the family's special tokens) and its 36 conversations, prints:
conversations kept, the generated strings (reasoning, answers, tool-call names) that no
supervised token holds, rows per conversation, and the tokens extraction reads against the
tokens the rows hold once their shared prefixes are counted once.

    .venv/bin/python benchmarks/bench_chat_formats.py
"""

from __future__ import annotations

import json
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from transformers import AutoTokenizer  # noqa: E402

from tests.chat_families import FAMILIES, build_tokenizer, conversation_set  # noqa: E402
from workflow_scripts.lib.chat.tokenization import read_conversation, tokenize_rows  # noqa: E402
from workflow_scripts.lib.chat.rows import BadRow  # noqa: E402
from workflow_scripts.lib.chat.template import ChatTemplate  # noqa: E402
from workflow_scripts.lib.chat.turns import unique_tokens  # noqa: E402


def measure(name: str, out: Path) -> dict:
    fam = FAMILIES[name]
    path = build_tokenizer(fam, out / name)
    template = ChatTemplate(AutoTokenizer.from_pretrained(path), fam.serving_kwargs, None, path)
    kept, rows, extracted, unique = 0, 0, 0, 0
    strings = missed = 0
    bad: Counter = Counter()
    for raw in conversation_set(fam):
        conv = read_conversation(raw)
        said = [conv.texts(j) for j, m in enumerate(conv.messages) if m["role"] == "assistant"]
        wanted = [s for t in said for s in (t["reasoning"], t["answer"], *t["tool_names"]) if s]
        strings += len(wanted)
        try:
            built, _ = tokenize_rows(template, conv, 1 << 20)
        except BadRow as exc:
            bad[exc.reason] += 1
            missed += len(wanted)
            continue
        text = "".join(
            template.decode([t for t, m in zip(r.input_ids, r.loss_mask) if m]) for r in built
        )
        missed += sum(s not in text for s in wanted)
        kept += 1
        rows += len(built)
        extracted += sum(len(r.input_ids) for r in built)
        unique += unique_tokens(built)
    return {
        "family": name,
        "serving_kwargs": fam.serving_kwargs,
        "kept": kept,
        "of": 36,
        "unsupervised": missed,
        "strings": strings,
        "rows_per_conversation": round(rows / max(kept, 1), 2),
        "extracted_over_unique": round(extracted / max(unique, 1), 3),
        "bad": dict(bad),
    }


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        results = [measure(name, Path(tmp)) for name in FAMILIES]
    print("| template | rows kept of 36 | generated strings never supervised | rows per "
          "conversation | extracted / unique tokens |")  # fmt: skip
    print("|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['family']} | {r['kept']} | {r['unsupervised']} of {r['strings']} | "
            f"{r['rows_per_conversation']} | {r['extracted_over_unique']} |"
        )
    print(json.dumps(results))


if __name__ == "__main__":
    main()
