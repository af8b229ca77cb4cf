"""The documentation against the repository: the README stays a front page that links every page
under docs/, and every link, anchor and repository path the documents name exists."""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

import pytest

from workflow_scripts.lib.workflow.config import DOCS, json_schema, keyed_properties

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
README_MAX_BYTES = 15_000
DOCUMENTS = sorted(
    [
        README,
        ROOT / "ARCHITECTURE.md",
        ROOT / "profiles/slurm/README.md",
        *(ROOT / "docs").glob("*.md"),
    ]
)
# the folders whose paths, written in backticks, must exist
PATH_PREFIXES = (
    "workflow_scripts/",
    "rules/",
    "tests/",
    "benchmarks/",
    "profiles/",
    "docs/",
    "envs/",
)

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
CODE_SPAN = re.compile(r"`([^`]+)`")


def prose(text: str) -> str:
    """The text without its code blocks (fenced, or indented four spaces after a blank line)."""
    kept, fenced, in_code, previous_blank = [], False, False, True
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        in_code = bool(line.strip()) and line.startswith("    ") and (previous_blank or in_code)
        if not fenced and not in_code:
            kept.append(line)
        previous_blank = not line.strip()
    return "\n".join(kept)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: markup dropped, lowercase, punctuation except - and _ dropped,
    each space a -."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
    text = re.sub(r"[`*]", "", text).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors_of(text: str) -> set[str]:
    """The anchors of a markdown text's headings; repeated headings get -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    result = set()
    for line in prose(text).splitlines():
        match = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        base = slug(match.group(1))
        count = seen.get(base, 0)
        seen[base] = count + 1
        result.add(base if count == 0 else f"{base}-{count}")
    return result


def relative_links(text: str) -> list[str]:
    """The targets of the relative markdown links in a text (URLs with a scheme left out)."""
    return [
        target
        for target in LINK.findall(prose(text))
        if not re.match(r"[a-z][a-z0-9+.-]*:", target, re.IGNORECASE)
    ]


def repository_paths(text: str) -> list[str]:
    """The repository paths written in backticks: the first word of a code span that starts with
    one of PATH_PREFIXES, without a trailing `::name`, `:line` or `: description`; paths with a
    placeholder (`<stage>`) or a glob (`*`) are left out."""
    paths = []
    for span in CODE_SPAN.findall(prose(text)):
        words = span.split()
        if not words or not words[0].startswith(PATH_PREFIXES):
            continue
        candidate = words[0].split("::", 1)[0].split(":", 1)[0].rstrip(".,;)")
        if "<" in candidate or "*" in candidate or "{" in candidate:
            continue
        paths.append(candidate)
    return paths


def name(path: Path) -> str:
    return str(path.relative_to(ROOT))


def test_readme_is_a_front_page():
    size = len(README.read_bytes())
    assert (
        size <= README_MAX_BYTES
    ), f"README.md is {size} bytes, more than {README_MAX_BYTES}: move reference text to docs/"


def test_readme_links_every_docs_page():
    linked = {
        (README.parent / target.split("#", 1)[0]).resolve()
        for target in relative_links(README.read_text())
    }
    pages = sorted(p for p in (ROOT / "docs").rglob("*") if p.is_file())
    assert pages, "docs/ holds no page"
    unlinked = [name(p) for p in pages if p.resolve() not in linked]
    assert not unlinked, f"README.md does not link: {', '.join(unlinked)}"


@pytest.mark.parametrize("document", DOCUMENTS, ids=name)
def test_relative_links_resolve(document):
    broken = []
    for target in relative_links(document.read_text()):
        file_part, _, anchor = target.partition("#")
        linked = (document.parent / file_part).resolve() if file_part else document
        if not linked.exists():
            broken.append(f"{target}: no file {file_part}")
        elif anchor and linked.suffix == ".md" and anchor not in anchors_of(linked.read_text()):
            broken.append(f"{target}: no heading #{anchor} in {name(linked)}")
    assert not broken, f"{name(document)} links to what does not exist:\n" + "\n".join(broken)


@pytest.mark.parametrize("document", DOCUMENTS, ids=name)
def test_repository_paths_exist(document):
    missing = sorted({p for p in repository_paths(document.read_text()) if not (ROOT / p).exists()})
    assert not missing, f"{name(document)} names paths that do not exist:\n" + "\n".join(missing)


def test_the_checks_find_what_they_look_for():
    """The helpers read links, anchors and paths as GitHub does, so that the checks can fail."""
    assert slug("Regenerating the answers with the verifier (self-distillation)") == (
        "regenerating-the-answers-with-the-verifier-self-distillation"
    )
    assert slug("The recipe's `train.loss`, DeepSeek/Kimi") == "the-recipes-trainloss-deepseekkimi"
    text = "See [a](docs/x.md#y), [b](https://example.org) and [c](#z).\n\n    [d](in/code.md)\n"
    assert relative_links(text) == ["docs/x.md#y", "#z"]
    text = (
        "`tests/test_x.py::test_y`, `rules/a.smk:12`, `tests/s.py: run`, `rules/*.smk`,\n`x/y.py`"
    )
    assert repository_paths(text + " `workflow_scripts/stages/<stage>.py`") == [
        "tests/test_x.py",
        "rules/a.smk",
        "tests/s.py",
    ]
    headings = "# Title\n\n## Notes\n\n## Notes\n\n    # not a heading\n"
    assert anchors_of(headings) == {"title", "notes", "notes-1"}


def resolves(page: str) -> str | None:
    """None where ``page`` (path#heading from the repository's root) exists; else what is wrong."""
    file_part, _, anchor = page.partition("#")
    path = ROOT / file_part
    if not path.is_file():
        return f"{page}: no file {file_part}"
    if anchor and anchor not in anchors_of(path.read_text()):
        return f"{page}: no heading #{anchor} in {file_part}"
    return None


def test_every_page_the_config_schema_names_exists():
    """Keys needing more than a line end their schema description with a page (config.DOCS)."""
    described = re.findall(r"More: (\S+)\"", (ROOT / "config.schema.json").read_text())
    assert described, "no key of config.schema.json names a page"
    assert set(described) == set(DOCS.values())
    broken = [problem for page in sorted(set(described)) if (problem := resolves(page))]
    assert not broken, "config.schema.json names pages that do not exist:\n" + "\n".join(broken)


def test_every_docs_pattern_names_a_config_key():
    keys = [key for key, _ in keyed_properties(json_schema())]
    assert "train.loss" in keys and "chat_data.weight" in keys and "verifier" in keys
    unused = [p for p in DOCS if not any(fnmatch.fnmatchcase(k, p) for k in keys)]
    assert not unused, f"config.DOCS patterns that match no config key: {unused}"


def test_the_configuration_page_lists_the_schemas_pages():
    """docs/configuration.md's table of keys and pages is config.DOCS, row for row."""
    page = ROOT / "docs" / "configuration.md"
    table = page.read_text().split("## Where each setting is explained", 1)[1].split("\n## ", 1)[0]
    listed = {}
    for row in table.splitlines():
        cells = row.split("|")
        links = LINK.findall(row)
        if len(cells) < 3 or not links or not CODE_SPAN.findall(cells[1]):
            continue
        target = (page.parent / links[0].split("#")[0]).resolve().relative_to(ROOT)
        for key in CODE_SPAN.findall(cells[1]):
            listed[key] = f"{target}#{links[0].split('#', 1)[1]}"
    assert listed == DOCS
