"""Natural-text chat data for the quality benchmark: conversations made from the documentation
shipped inside installed Python packages (their docstrings), read from disk, never downloaded.

A *document* is one docstring (of a module, class or function) with at least one paragraph of
prose; a paragraph is prose when it is long enough and mostly letters (parameter tables, code
examples and markup are left out), and a paragraph with a sentence seen before is left out (repeated
boilerplate would make the text easier to predict than real text, and a held-out paragraph
could be part of a training one). A conversation is one
document: the user quotes the opening of a paragraph and asks for the rest, the assistant
answers with it; the following turns ask for the next paragraphs.

Held-out documents: every docstring of a module file that a stable hash of its path reserves is
kept out of training; the evaluation prompts come only from those. The packages are read in a
fixed order (sorted files, source order within a file), so with the pinned requirements the same
seed gives the same bytes on every machine.
"""

from __future__ import annotations

import ast
import itertools
import random
import re
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from workflow_scripts.lib.common import UserError

EVAL_SHARE = 5  # one module file in EVAL_SHARE is held out (several hundred evaluation prompts)
MIN_PARAGRAPH_CHARS = 160
MAX_PARAGRAPH_CHARS = 1200
MIN_PROSE_RATIO = 0.9  # letters and spaces per character
MAX_TURNS = 3
SENTENCE_END = re.compile(r"(?<=[a-z0-9\)][.!?]) (?=[A-Z])")

SYSTEM_PROMPTS = [
    "You are a helpful assistant who knows Python libraries well.",
    "You are a precise technical writer. Continue the documentation you are shown.",
    "You are an assistant that answers questions about software documentation.",
]
OPENINGS = [
    "Continue this passage from the documentation of {where}:\n\n{opening}",
    "Here is the start of a paragraph from the {package} docs ({where}). How does it go on?"
    "\n\n{opening}",
    "Finish the following text from {where}:\n\n{opening}",
]
FOLLOW_UPS = ["Go on.", "What comes next?", "Continue, please.", "And after that?"]


@dataclass(frozen=True)
class Document:
    package: str
    where: str  # module path and object name, e.g. networkx.algorithms.dag.topological_sort
    paragraphs: tuple[str, ...]
    held_out: bool


def _site_packages() -> list[Path]:
    return [Path(p) for p in sys.path if p.endswith("site-packages") and Path(p).is_dir()]


def package_dir(package: str) -> Path:
    """The directory of an installed (importable) top-level package, found without importing it."""
    for root in _site_packages():
        if (root / package / "__init__.py").is_file():
            return root / package
    raise UserError(
        f"demo.corpus_packages: package {package!r} is not installed in {sys.prefix}; "
        "name packages of envs/requirements-cpu.lock (make venv installs them)"
    )


def is_prose(paragraph: str) -> bool:
    if not MIN_PARAGRAPH_CHARS <= len(paragraph) <= MAX_PARAGRAPH_CHARS:
        return False
    if (
        "--" in paragraph
        or "==" in paragraph
        or ">>>" in paragraph
        or "::" in paragraph
        or "`" in paragraph
        or "http" in paragraph
    ):
        return False
    letters = sum(c.isalpha() or c == " " for c in paragraph)
    return letters / len(paragraph) >= MIN_PROSE_RATIO and paragraph[0].isupper()


def _docstrings(path: Path) -> Iterator[tuple[str, str]]:
    """(object name, docstring) of a module file in source order; nothing if it does not parse."""
    try:
        tree = ast.parse(path.read_bytes())
    except (SyntaxError, ValueError):
        return
    nodes = [tree] + [
        n
        for n in ast.walk(tree)
        if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
    ]
    nodes.sort(key=lambda n: getattr(n, "lineno", 0))
    for node in nodes:
        doc = ast.get_docstring(node)
        if doc:
            yield getattr(node, "name", ""), doc


def read_documents(packages: list[str]) -> list[Document]:
    """Every document of the packages, in a fixed order, each sentence used once."""
    seen: set[str] = set()
    docs = []
    for package in packages:
        root = package_dir(package)
        for path in sorted(root.rglob("*.py")):
            rel = path.relative_to(root.parent).with_suffix("").as_posix()
            if "/tests/" in f"/{rel}/" or "/testing/" in f"/{rel}/":
                continue
            module = rel.replace("/", ".").removesuffix(".__init__")
            held_out = zlib.crc32(rel.encode()) % EVAL_SHARE == 0
            for name, doc in _docstrings(path):
                paragraphs = []
                for block in re.split(r"\n\s*\n", doc):
                    text = " ".join(block.split())
                    sentences = SENTENCE_END.split(text)
                    if is_prose(text) and not seen.intersection(sentences):
                        seen.update(sentences)
                        paragraphs.append(text)
                if paragraphs:
                    where = f"{module}.{name}" if name else module
                    docs.append(Document(package, where, tuple(paragraphs), held_out))
    return docs


def split_opening(paragraph: str, rng: random.Random) -> tuple[str, str]:
    """(opening the user quotes, rest the assistant writes): the first sentence when the
    paragraph has more than one, else its first few words."""
    sentences = SENTENCE_END.split(paragraph, maxsplit=1)
    if len(sentences) == 2:
        return sentences[0], sentences[1]
    words = paragraph.split(" ")
    cut = min(len(words) - 4, rng.randint(6, 12))
    return " ".join(words[:cut]), " ".join(words[cut:])


def conversation(doc: Document, rng: random.Random, idx: str) -> dict:
    opening, rest = split_opening(doc.paragraphs[0], rng)
    ask = rng.choice(OPENINGS).format(where=doc.where, package=doc.package, opening=opening)
    messages = [
        {"role": "system", "content": rng.choice(SYSTEM_PROMPTS)},
        {"role": "user", "content": ask},
        {"role": "assistant", "content": rest},
    ]
    for paragraph in doc.paragraphs[1:MAX_TURNS]:
        messages.append({"role": "user", "content": rng.choice(FOLLOW_UPS)})
        messages.append({"role": "assistant", "content": paragraph})
    return {"id": idx, "messages": messages}


class DocsCorpus:
    """Conversations from the packages' documentation: ``iter_conversations`` (training, without
    end: the training documents in a new shuffled order each pass), ``generate_conversations``
    and ``generate_eval_prompts`` (held-out documents)."""

    def __init__(self, seed: int, packages: list[str]):
        self.seed = seed
        docs = read_documents(packages)
        self.train = [d for d in docs if not d.held_out]
        self.held_out = [d for d in docs if d.held_out]
        if not self.train or not self.held_out:
            raise UserError(
                f"demo.corpus_packages {packages}: {len(self.train)} training and "
                f"{len(self.held_out)} held-out documents; name more packages"
            )

    def summary(self) -> dict:
        def chars(docs):
            return sum(len(p) for d in docs for p in d.paragraphs)

        return {
            "train_documents": len(self.train),
            "train_chars": chars(self.train),
            "held_out_documents": len(self.held_out),
            "held_out_chars": chars(self.held_out),
        }

    def iter_conversations(self) -> Iterator[dict]:
        rng = random.Random(f"eagle3-docs-train-{self.seed}")
        for epoch in itertools.count():
            order = list(range(len(self.train)))
            rng.shuffle(order)
            for n, i in enumerate(order):
                yield conversation(self.train[i], rng, f"docs-{self.seed}-{epoch}-{n:06d}")

    def generate_conversations(self, num: int) -> list[dict]:
        return list(itertools.islice(self.iter_conversations(), num))

    def generate_eval_prompts(self, num: int) -> list[dict]:
        """``num`` prompts [system, user] from distinct held-out documents, the true rest of the
        paragraph under ``reference``."""
        if num > len(self.held_out):
            raise ValueError(f"there are only {len(self.held_out)} held-out documents")
        rng = random.Random(f"eagle3-docs-eval-{self.seed}")
        rows = []
        for n, doc in enumerate(rng.sample(self.held_out, num)):
            conv = conversation(doc, rng, f"docs-eval-{self.seed}-{n:04d}")
            rows.append(
                {
                    "id": conv["id"],
                    "family": doc.package,
                    "messages": conv["messages"][:2],
                    "reference": conv["messages"][2]["content"],
                }
            )
        return rows
