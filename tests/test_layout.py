"""docs/architecture.md's Layout section names every module with the first sentence of its opening comment."""

import ast
import re

from helpers import REPO

CONTINUATION = " " * 36  # the column where an entry's wrapped text goes on


def first_sentence(path) -> str:
    doc = ast.get_docstring(ast.parse(path.read_text()))
    assert doc, f"{path.relative_to(REPO)} has no opening comment"
    paragraph = " ".join(doc.split("\n\n")[0].split())
    return re.split(r"(?<=[a-z`)'])\.\s", paragraph)[0].rstrip(".")


def layout_entries() -> dict:
    section = REPO.joinpath("docs", "architecture.md").read_text().split("## Layout", 1)[1]
    entries, current = {}, None
    for line in section.splitlines():
        if line.startswith("    llama/"):
            current, _, text = line.strip().partition(" ")
            entries[current] = text.strip()
        elif line.startswith(CONTINUATION) and current is not None:
            entries[current] += " " + line.strip()
        else:
            current = None
    return entries


def test_every_module_is_listed_with_its_opening_sentence():
    modules = sorted(p for p in REPO.joinpath("llama").rglob("*.py") if "__pycache__" not in p.parts)
    entries = layout_entries()
    assert sorted(entries) == sorted(str(p.relative_to(REPO)) for p in modules)
    for path in modules:
        assert entries[str(path.relative_to(REPO))] == first_sentence(path), path
