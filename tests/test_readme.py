"""The README's Python examples run as written (in order, one namespace, as a
reader pasting them one after another would). The runnable ones are those
that start by importing torch or diffusers; the others are fragments."""
import pathlib
import re

import torch

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def python_blocks():
    text = README.read_text()
    return [b for b in re.findall(r"```python\n(.*?)```", text, flags=re.S) 
            if re.match(r"import (math, )?torch|import diffusers", b)]


def test_readme_examples_run():
    blocks = python_blocks()
    assert len(blocks) >= 3
    namespace = {}
    for block in blocks:
        exec(compile(block, str(README), "exec"), namespace)
    assert namespace["actions"].shape == (50, 6)
    assert torch.isfinite(namespace["actions"]).all() and namespace["out"].shape == (8, 64)


ROOT = README.parent
DOCS = [README, ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]


def named_paths(text: str) -> set[str]:
    """The repository paths a Markdown text names: in backticks (inline or
    fenced) every word that starts with a top-level entry of the repository
    and a slash, and the targets of relative links. Patterns (``*``,
    ``<name>``, ``{a,b}``) are not paths."""
    tops = {p.name for p in ROOT.iterdir() if not p.name.startswith(".")}
    quoted = re.findall(r"```[^\n]*\n(.*?)```", text, flags=re.S)
    quoted += re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S))
    words = {w.rstrip(".:") for q in quoted for w in re.findall(r"[\w./*<>{}-]+", q)}
    paths = {w for w in words if "/" in w and w.split("/")[0] in tops and not set(w) & set("*<>{}")}
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    return paths | {link for link in links if "://" not in link}


def test_docs_name_files_that_exist():
    missing, checked = [], 0
    for doc in DOCS:
        for path in sorted(named_paths(doc.read_text())):
            checked += 1
            if not (doc.parent / path).exists() and not (ROOT / path).exists():
                missing.append(f"{doc.relative_to(ROOT)}: {path}")
    assert checked > 50
    assert not missing, "\n".join(missing)
