"""The book withholds the graded answers when a class runs: ``graded-listing`` and ``graded_listings``."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "book" / "_ext"))

import graded_listing  # noqa: E402 - a local Sphinx extension of the book, not a package

# Listings of mha_lab code that answer a graded task, and the problem set each answers.
ANSWERS = {"softmax": "ps1", "decode_step": "ps2", "repeat_kv": "ps2", "head_by_head_forward": "ps3",
           "chunked_attention": "ps3", "online_softmax_step": "ps3",
           "scaled_dot_product_attention_backward": "ps4", "GroupedQueryAttention.backward": "ps4"}
LISTING = re.compile(r"```\{(?P<kind>[\w-]+)\} (?P<path>\S+)\n(?P<options>(?::[\w-]+:.*\n)+)```")


def listings() -> list[tuple[str, str, dict[str, str]]]:
    """(chapter, directive, options) of every code listing with a :pyobject: in the book."""
    found = []
    for chapter in sorted((REPO / "book").glob("*.md")):
        for m in LISTING.finditer(chapter.read_text()):
            options = dict(re.findall(r"^:([\w-]+): *(.*)$", m["options"], re.M))
            if "pyobject" in options:
                found.append((chapter.name, m["kind"], options))
    return found


def test_every_graded_answer_in_the_book_is_a_graded_listing():
    seen = set()
    for chapter, kind, options in listings():
        answer = options["pyobject"]
        if answer in ANSWERS:
            seen.add(answer)
            assert kind == "graded-listing", f"{chapter} prints {answer}, the answer of {ANSWERS[answer]}, with {kind}"
            assert options.get("assignment") == ANSWERS[answer], f"{chapter}: {answer} answers {ANSWERS[answer]}"
        else:
            assert kind != "graded-listing", f"{chapter}: {answer} is not an answer; use literalinclude"
    assert len(seen) >= 5, f"the book's graded listings went missing: only {sorted(seen)}"


def test_the_book_config_names_a_mode_and_loads_the_extension():
    config = (REPO / "_config.yml").read_text()
    assert re.search(r"^    graded_listings: (show|fold|hide)\b", config, re.M)
    assert re.search(r"^    graded_listing: book/_ext$", config, re.M)


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = tmp_path_factory.mktemp("book")
    (src / "answer.py").write_text("def answer(x):\n    return 42 * x  # THE-ANSWER\n\n\ndef other():\n    pass\n"
                                "\n\ndef named():\n    return 0  # THE-NAMED\n")
    (src / "conf.py").write_text(f"import sys\nsys.path.insert(0, {str(REPO / 'book' / '_ext')!r})\n"
                                 "extensions = ['graded_listing']\n")
    (src / "index.rst").write_text("Page\n====\n\n.. graded-listing:: answer.py\n   :pyobject: answer\n"
                                   "   :assignment: ps3\n\n.. graded-listing:: answer.py\n   :pyobject: named\n"
                                   "   :assignment: ps4\n   :title: Class.named\n")
    return src


def build(src: Path, out: Path, mode: str) -> str:
    from sphinx.application import Sphinx

    app = Sphinx(str(src), str(src), str(out), str(out / ".doctrees"), "html", status=None, warning=None,
                 confoverrides={"graded_listings": mode}, freshenv=True)
    app.build()
    return (out / "index.html").read_text()


@pytest.mark.parametrize(("mode", "code_shown", "marked"), [("show", True, False), ("fold", True, True),
                                                           ("hide", False, True)])
def test_each_mode_shows_folds_or_leaves_out_the_answer(project, tmp_path, mode, code_shown, marked):
    page = build(project, tmp_path / mode, mode)
    assert ("THE-ANSWER" in page) == code_shown
    assert ("Solution: answer (problem set 3)" in page) == marked
    assert ("Solution: Class.named (problem set 4)" in page) == marked  # :title: names it, not :pyobject:
    assert "Solution: named" not in page and ("THE-NAMED" in page) == code_shown
    if mode == "fold":
        assert re.search(r'class="[^"]*dropdown[^"]*"', page), "the solution block must start closed"
    assert "def other" not in page


def test_the_environment_overrides_the_config(monkeypatch):
    monkeypatch.setenv(graded_listing.ENV, "hide")
    assert graded_listing.mode(type("Config", (), {"graded_listings": "show"})) == "hide"
    monkeypatch.setenv(graded_listing.ENV, "secret")
    with pytest.raises(ValueError, match="graded_listings must be one of"):
        graded_listing.mode(type("Config", (), {"graded_listings": "show"}))
