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
