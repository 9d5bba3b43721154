"""The book's sentences that a reader could check against the code or the literature, checked here.

Each test reads a chapter's source (found by its label, so the file's name does not matter) and
holds a sentence to the code or numbers it describes: an old wrong sentence fails, the corrected
one passes.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

BOOK = Path(__file__).resolve().parents[1] / "book"


def page(label: str) -> str:
    """The MyST source of the page whose first line is ``(label)=``."""
    for path in sorted(BOOK.glob("*.md")):
        text = path.read_text()
        if text.split("---\n", 2)[-1].lstrip().startswith(f"({label})="):
            return text
    raise LookupError(f"no page starts with the label {label}")


def prose(label: str) -> str:
    """The page's text outside code cells, with line breaks folded to spaces."""
    text = re.sub(r"```\{code-cell\}.*?```", "", page(label), flags=re.S)
    return re.sub(r"\s+", " ", text)


def test_mla_decoding_applies_w_uv_then_w_o_as_the_page_says():
    from mha_lab.cpu.latent import LatentAttention

    code = inspect.getsource(LatentAttention._attend_latent)
    assert "@ W_UV" in code and "@ self.W_O" in code and "einsum" not in code
    text = prose("ch-gqa")
    assert "forms the product only to show" not in text and "above used both" not in text
    assert "applies $W_{UV}$ and then $W_O$" in text
    assert "That is the order `LatentAttention._attend_latent` uses." in text
