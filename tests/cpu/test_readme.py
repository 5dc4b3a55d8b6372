"""README's "The API in ten lines" is a complete program: this test runs that code block as README.md
holds it (so the two cannot drift), on the CPU with the reference backend and on a GPU with the kernels."""
from pathlib import Path

import torch

README = Path(__file__).resolve().parents[2] / "README.md"
SECTION = "## The API in ten lines"


def api_block() -> str:
    """The first ```python block of README's API section."""
    text = README.read_text()
    assert SECTION in text, f"README.md has no section {SECTION!r}"
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    assert "```python\n" in section, f"README.md's {SECTION!r} has no ```python block"
    return section.split("```python\n", 1)[1].split("```", 1)[0]


def test_readme_api_block_runs_as_written():
    code = api_block()
    assert 10 <= len(code.strip().splitlines()) <= 16, "keep README's API example about ten lines"
    namespace = {"__name__": "__main__"}
    exec(compile(code, f"{README}:{SECTION}", "exec"), namespace)   # a fresh namespace: it imports what it needs
    o, o1, q = namespace["o"], namespace["o1"], namespace["q"]
    assert o.shape == q.shape and o1.shape == (1, *q.shape[1:])
    assert torch.isfinite(o).all() and torch.isfinite(o1).all()
    # The decode query is the prompt's last row over the same keys: the prefill's last output row, up to
    # the recipe's FP8 Q and P rounding in prefill.
    err = ((o[-1].double() - o1[0].double()).norm() / o1.double().norm()).item()
    assert err < 0.1, f"decode of the last prompt row differs from the prefill's last row: rel-L2 {err:.3f}"
