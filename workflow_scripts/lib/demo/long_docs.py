"""Long-context chat data for the long-context benchmark: the package documentation of
``docs.py``, a long run of it in the prompt, and questions the verifier answers by reading it.

A *passage* is a run of consecutive paragraphs of the documents of one package and split
(training or held out), in the packages' fixed order, from a paragraph drawn at random, as many
as fit a length drawn log-uniformly from ``chars`` (each document's paragraphs after its object
path). A conversation gives the passage in its first user turn and asks for the rest of a
paragraph of it whose opening it quotes; the assistant writes the rest; each following turn
quotes the opening of another paragraph of the passage, from anywhere in it. The answers are in
the prompt, often thousands of tokens back, so a verifier trained on these conversations learns
to find and copy them, and a draft must follow it there: the mechanism of long documents, long
agentic sessions and code edits that users serve drafts on.

Held-out passages are made of held-out documents only (``docs.py``: one module file in 5), so
the verifier cannot answer them from memory; the evaluation prompts are spread evenly over the
log of the passage length, from the shortest to the longest, so that every context-length
bucket is reached. The same seed gives the same bytes on every machine with the pinned
requirements.
"""

from __future__ import annotations

import itertools
import math
import random
from typing import Iterator

from workflow_scripts.lib.common import UserError
from workflow_scripts.lib.demo.docs import Document, read_documents, split_opening

MAX_TURNS = 4  # questions about one passage
SYSTEM_PROMPTS = [
    "You are a helpful assistant who reads documentation carefully.",
    "You are a precise assistant. Answer from the documents you are given.",
    "You are an assistant that quotes software documentation exactly.",
]
INTROS = [
    "Here is part of the documentation of {package}:",
    "Read these pages from the {package} docs.",
    "The following text comes from the documentation of {package}.",
]
QUESTIONS = [
    'Continue the paragraph that begins "{opening}"',
    'How does the paragraph starting with "{opening}" go on?',
    'Finish this paragraph from the text above: "{opening}"',
]


def document_text(doc: Document, paragraphs: list[str] | None = None) -> str:
    return "\n\n".join((doc.where, *(doc.paragraphs if paragraphs is None else paragraphs)))


class LongDocsCorpus:
    """Conversations over long passages: ``iter_conversations`` (training, without end),
    ``generate_conversations`` and ``generate_eval_prompts`` (held-out passages)."""

    def __init__(self, seed: int, packages: list[str], chars: tuple[int, int]):
        self.seed = seed
        self.chars = chars
        # the documents of each package and split, in the packages' order
        by_split: dict[tuple[str, bool], list[Document]] = {}
        for doc in read_documents(packages):
            by_split.setdefault((doc.package, doc.held_out), []).append(doc)
        self.train = [run for (_, held_out), run in by_split.items() if not held_out]
        self.held_out = [run for (_, held_out), run in by_split.items() if held_out]
        # each run as its (document, paragraph) pairs, for passages
        self.units = {
            id(runs): [[(d, p) for d in run for p in d.paragraphs] for run in runs]
            for runs in (self.train, self.held_out)
        }
        for name, runs in (("training", self.train), ("held-out", self.held_out)):
            longest = max((sum(len(document_text(d)) for d in r) for r in runs), default=0)
            if longest < chars[1]:
                raise UserError(
                    f"demo.long_docs_chars {list(chars)}: the {name} documents of the largest "
                    f"package in demo.corpus_packages {packages} have {longest} characters; "
                    "lower the longest passage or name more packages"
                )

    def summary(self) -> dict:
        return {
            "train_documents": sum(map(len, self.train)),
            "held_out_documents": sum(map(len, self.held_out)),
            "passage_chars": list(self.chars),
        }

    def passage(self, runs: list[list[Document]], length: int, rng: random.Random):
        """Consecutive paragraphs of one run, with their documents' paths, of at most ``length``
        characters (one paragraph at least), from a random start (moved back where the rest of
        the run is too short): a list of (document, its paragraphs in the passage)."""
        units = self.units[id(runs)]
        r = rng.choice([i for i, u in enumerate(units) if sum(len(p) for _, p in u) >= length])
        run = units[r]
        start = rng.randrange(len(run))
        rest = sum(len(p) + 2 for _, p in run[start:])
        while start and rest < length:
            start -= 1
            rest += len(run[start][1]) + 2
        picked, total = [], 0
        for doc, paragraph in run[start:]:
            new_doc = not picked or picked[-1][0] is not doc
            size = len(paragraph) + 2 + (len(doc.where) + 2 if new_doc else 0)
            if picked and total + size > length:
                break
            if new_doc:
                picked.append((doc, [paragraph]))
            else:
                picked[-1][1].append(paragraph)
            total += size
        return picked

    def conversation(self, passage, rng: random.Random, idx: str) -> dict:
        paragraphs = [p for _, ps in passage for p in ps]
        asked = rng.sample(paragraphs, min(MAX_TURNS, len(paragraphs)))
        text = "\n\n".join(document_text(d, ps) for d, ps in passage)
        messages = [{"role": "system", "content": rng.choice(SYSTEM_PROMPTS)}]
        for turn, paragraph in enumerate(asked):
            opening, rest = split_opening(paragraph, rng)
            question = rng.choice(QUESTIONS).format(opening=opening)
            if turn == 0:
                intro = rng.choice(INTROS).format(package=passage[0][0].package)
                question = f"{intro}\n\n{text}\n\n{question}"
            messages.append({"role": "user", "content": question})
            messages.append({"role": "assistant", "content": rest})
        return {"id": idx, "messages": messages}

    def _length(self, rng: random.Random) -> int:
        lo, hi = map(math.log, self.chars)
        return round(math.exp(rng.uniform(lo, hi)))

    def iter_conversations(self) -> Iterator[dict]:
        rng = random.Random(f"eagle3-long-docs-train-{self.seed}")
        for n in itertools.count():
            passage = self.passage(self.train, self._length(rng), rng)
            yield self.conversation(passage, rng, f"long-docs-{self.seed}-{n:06d}")

    def generate_conversations(self, num: int) -> list[dict]:
        return list(itertools.islice(self.iter_conversations(), num))

    def generate_eval_prompts(self, num: int) -> list[dict]:
        """``num`` prompts [system, user] over held-out passages whose lengths are spread
        evenly over the log of demo.long_docs_chars, the true rest of the paragraph under
        ``reference``."""
        rng = random.Random(f"eagle3-long-docs-eval-{self.seed}")
        lo, hi = map(math.log, self.chars)
        rows = []
        for n in range(num):
            length = round(math.exp(lo + (n + 0.5) / num * (hi - lo)))
            passage = self.passage(self.held_out, length, rng)
            conv = self.conversation(passage, rng, f"long-docs-eval-{self.seed}-{n:04d}")
            rows.append(
                {
                    "id": conv["id"],
                    "family": passage[0][0].package,
                    "messages": conv["messages"][:2],
                    "reference": conv["messages"][2]["content"],
                }
            )
        return rows
