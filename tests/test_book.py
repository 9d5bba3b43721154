"""Fast checks of the book's sources: no build, no browser.

The chapters are MyST markdown notebooks (``book/NN_*.md``, the files the site is built from). Each
has a committed ``.ipynb`` twin next to it, for the Colab and Binder launch buttons: the same cells
plus a first cell that installs ``mha_lab`` when it is missing. This module also writes those twins:

    python tests/test_book.py          # regenerate the .ipynb twins (``make book`` does this)
    python tests/test_book.py --check  # exit 1 when a twin is out of date (``make book`` in CI)
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import jupytext
import nbformat
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
BOOK = ROOT / "book"

# The book's fixed plan: file stem -> label of its first heading, in reading order.
PAGES = {
    "intro": "home",
    "notation": "notation",
    "01_intuition": "ch-intuition",
    "02_math": "ch-math",
    "03_reshape": "ch-reshape",
    "04_masking": "ch-masking",
    "05_positions": "ch-positions",
    "06_backward": "ch-backward",
    "07_flops_memory": "ch-flops",
    "08_gqa_mqa": "ch-gqa",
    "09_memory_efficient": "ch-memory",
    "10_decoding": "ch-decoding",
    "10_serving": "ch-serving",
    "11_tensor_parallel": "ch-tp",
    "11_context_parallel": "ch-cp",
    "12_pitfalls": "ch-pitfalls",
    "13_grading": "ch-grading",
    "bibliography": "bibliography",
}
CHAPTERS = [stem for stem in PAGES if stem not in ("intro", "notation", "13_grading", "bibliography")]  # they teach
BIB_KEYS = {
    "vaswani2017attention", "shazeer2019fast", "ainslie2023gqa", "dao2022flashattention",
    "dao2023flashattention2", "rabe2021self", "shoeybi2019megatron", "milakov2018online",
    "su2021roformer", "press2022alibi", "haviv2022transformer", "kazemnejad2023impact",
    "deepseek2024v2", "nvidia2022h100", "nvidia2024cuda", "jiang2023mistral",
    "kwon2023paged", "dao2023flashdecoding", "xiao2023streaming", "openai2025gptoss", "liu2024kivi",
    "hooper2024kvquant", "chen2023position", "peng2023yarn", "grattafiori2024llama3",
    "yu2022orca", "agrawal2023sarathi", "zheng2024sglang", "ye2025flashinfer", "leviathan2023fast",
    "chen2023accelerating", "liu2023ring", "jacobs2023ulysses",
}


# --------------------------------------------------------------------------------------------
# The .ipynb twins
# --------------------------------------------------------------------------------------------

def repository_url() -> str:
    """The repository URL from ``_config.yml``, the one place that names it."""
    return yaml.safe_load((ROOT / "_config.yml").read_text())["repository"]["url"]


def setup_cell_source() -> str:
    """First cell of every twin: install mha_lab where it is missing (Colab), a no-op elsewhere."""
    return (
        "# Set-up for Colab: install mha_lab from the repository when it is not installed yet.\n"
        "import importlib.util\n"
        "\n"
        'if importlib.util.find_spec("mha_lab") is None:\n'
        f'    %pip install --quiet "mha_lab @ git+{repository_url()}"'
    )


def is_notebook_source(path: Path) -> bool:
    """True for a MyST markdown notebook: a .md file whose front matter names a kernel."""
    text = path.read_text()
    if not text.startswith("---\n"):
        return False
    front = text.split("\n---\n", 1)[0]
    return "kernelspec:" in front


def notebook_sources() -> list[Path]:
    return sorted(p for p in BOOK.glob("*.md") if is_notebook_source(p))


def paired_notebook(md: Path) -> str:
    """The .ipynb twin of a MyST notebook, as text: deterministic, without outputs."""
    nb = jupytext.read(md)
    setup = nbformat.v4.new_code_cell(setup_cell_source(), metadata={"tags": ["remove-cell"]})
    nb.cells.insert(0, setup)
    for i, cell in enumerate(nb.cells):
        cell.id = f"cell-{i:03d}"  # stable ids keep the twin reproducible
    nb.metadata = {
        "kernelspec": nb.metadata["kernelspec"],
        "language_info": {"name": "python"},
        "colab": {"provenance": []},
    }
    return jupytext.writes(nb, fmt="ipynb")


def sync_notebooks(check: bool = False) -> list[Path]:
    """Write (or with ``check`` only list) the twins that are missing or out of date."""
    stale = []
    for md in notebook_sources():
        twin, text = md.with_suffix(".ipynb"), paired_notebook(md)
        if not twin.exists() or twin.read_text() != text:
            stale.append(twin)
            if not check:
                twin.write_text(text)
    return stale


# --------------------------------------------------------------------------------------------
# Reading the sources
# --------------------------------------------------------------------------------------------

def toc_entries() -> list[str]:
    """Every ``file:`` of ``_toc.yml`` (and its root), in order, as paths without suffix."""
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    entries = [toc["root"]]

    def walk(node):
        if isinstance(node, dict):
            if "file" in node:
                entries.append(node["file"])
            for key in ("parts", "chapters", "sections"):
                for child in node.get(key, []):
                    walk(child)

    walk(toc)
    return entries


def page_source(stem: str) -> Path:
    return BOOK / f"{stem}.md"


def code_cells(md: Path) -> list[str]:
    return [c.source for c in jupytext.read(md).cells if c.cell_type == "code"]


def package_public_names() -> set[str]:
    """Top-level public functions and classes of mha_lab, read from the source (no import)."""
    names = set()
    for path in (ROOT / "mha_lab").rglob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if not node.name.startswith("_"):
                    names.add(node.name)
    return names


def existing_chapters() -> list[str]:
    return [stem for stem in CHAPTERS if page_source(stem).exists()]


# --------------------------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------------------------

def test_toc_entries_exist():
    missing = [e for e in toc_entries() if not (ROOT / f"{e}.md").exists() and not (ROOT / f"{e}.ipynb").exists()]
    assert not missing, f"_toc.yml lists pages that do not exist: {missing}"


def test_toc_lists_the_planned_pages_in_order():
    assert toc_entries() == [f"book/{stem}" for stem in PAGES], "the toc must list the book's pages in reading order"


def test_every_page_in_book_is_in_the_toc():
    listed = set(toc_entries())
    orphans = [p.name for p in BOOK.glob("*.md") if f"book/{p.stem}" not in listed]
    assert not orphans, f"pages in book/ missing from _toc.yml: {orphans}"


@pytest.mark.parametrize("stem", list(PAGES))
def test_page_starts_with_its_label(stem):
    md = page_source(stem)
    if not md.exists():
        pytest.fail(f"{md.relative_to(ROOT)} does not exist")
    body = md.read_text()
    if body.startswith("---\n"):
        body = body.split("\n---\n", 1)[1]
    first = [line for line in body.splitlines() if line.strip()][:2]
    assert first[0] == f"({PAGES[stem]})=", f"{md.name} must open with the label ({PAGES[stem]})="
    assert first[1].startswith("# "), f"{md.name}: the label must sit right above the page title"


def test_paired_notebooks_are_in_sync():
    stale = sync_notebooks(check=True)
    assert not stale, f"out-of-date .ipynb twins, run `make book` or `python tests/test_book.py`: {stale}"
    twins = {p.stem for p in BOOK.glob("*.ipynb")}
    sources = {p.stem for p in notebook_sources()}
    assert twins == sources, f".ipynb files without a MyST source: {sorted(twins - sources)}"


def test_paired_notebook_installs_mha_lab_first():
    md = next(iter(notebook_sources()), None)
    assert md is not None, "no chapter notebook found in book/"
    nb = nbformat.reads(paired_notebook(md), as_version=4)
    first = nb.cells[0]
    assert first.cell_type == "code" and "%pip install" in first.source and repository_url() in first.source
    assert 'find_spec("mha_lab") is None' in first.source, "the install must be skipped where mha_lab exists"
    assert [c.source for c in nb.cells[1:]] == [c.source for c in jupytext.read(md).cells]


@pytest.mark.parametrize("stem", CHAPTERS)
def test_chapter_is_a_notebook(stem):
    md = page_source(stem)
    if not md.exists():
        pytest.fail(f"{md.relative_to(ROOT)} does not exist")
    assert is_notebook_source(md), f"{md.name} needs jupytext front matter with a python3 kernelspec"
    assert jupytext.read(md).metadata["kernelspec"]["name"] == "python3"


@pytest.mark.parametrize("stem", CHAPTERS)
def test_chapter_ends_with_exercises_and_folded_solutions(stem):
    md = page_source(stem)
    if not md.exists():
        pytest.fail(f"{md.relative_to(ROOT)} does not exist")
    text = md.read_text()
    assert re.search(r"^## Exercises\s*$", text, re.M), f"{md.name} has no '## Exercises' section"
    exercises = re.findall(r"^(`{3,}|:{3,})\{exercise\}.*?\n((?:\s*:\w[\w-]*:.*\n)*)", text, re.M)
    assert exercises, f"{md.name} has no {{exercise}} directive"
    labels = []
    for _fence, options in exercises:
        label = re.search(r":label:\s*(\S+)", options)
        assert label, f"{md.name}: every exercise needs a :label:"
        labels.append(label.group(1))
    solutions = re.findall(r"^(`{3,}|:{3,})\{solution\}\s*(\S+)\s*\n((?:\s*:\w[\w-]*:.*\n)*)", text, re.M)
    solved = {target for _fence, target, _options in solutions}
    assert set(labels) <= solved, f"{md.name}: exercises without a solution: {sorted(set(labels) - solved)}"
    for _fence, target, options in solutions:
        assert re.search(r":class:\s*dropdown", options), f"{md.name}: solution to {target} is not folded"


@pytest.mark.parametrize("stem", CHAPTERS)
def test_chapter_links_a_graded_assignment(stem):
    md = page_source(stem)
    if not md.exists():
        pytest.fail(f"{md.relative_to(ROOT)} does not exist")
    assert re.search(r"\{ref\}`(?:[^`<]*<)?assignment-ps[1-6]>?`", md.read_text()), (
        f"{md.name} does not link a graded assignment ({{ref}}`assignment-psN`)"
    )


@pytest.mark.parametrize("stem", CHAPTERS)
def test_chapter_does_not_redefine_package_code(stem):
    md = page_source(stem)
    if not md.exists():
        pytest.fail(f"{md.relative_to(ROOT)} does not exist")
    public = package_public_names()
    for source in code_cells(md):
        python = "\n".join(line for line in source.splitlines() if not line.lstrip().startswith(("%", "!")))
        for node in ast.walk(ast.parse(python)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defined = [node.name]
            elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Lambda):
                defined = [t.id for t in node.targets if isinstance(t, ast.Name)]
            else:
                continue
            clash = sorted(set(defined) & public)
            assert not clash, f"{md.name} redefines mha_lab's {clash}: import it instead"


def test_grading_page_has_a_section_per_assignment():
    text = page_source("13_grading").read_text()
    names = ["ps1_per_head_loop", "ps2_mqa", "ps3_memory_efficient", "ps4_backward", "ps5_decoding",
             "ps6_ring_speculative"]
    for n, name in enumerate(names, start=1):
        assert f"(assignment-ps{n})=" in text, f"13_grading.md lacks the label assignment-ps{n}"
        assert f"{{download}}`../assignments/{name}/{name}.ipynb`" in text or (
            f"<../assignments/{name}/{name}.ipynb>`" in text
        ), f"13_grading.md does not offer {name}.ipynb for download"


def test_bibliography_has_exactly_the_agreed_keys():
    keys = set(re.findall(r"^@\w+\{([^,]+),", (BOOK / "references.bib").read_text(), re.M))
    assert keys == BIB_KEYS


def test_every_citation_is_in_the_bibliography():
    for md in BOOK.glob("*.md"):
        for group in re.findall(r"\{cite(?::\w+)?\}`([^`]+)`", md.read_text()):
            unknown = {k.strip() for k in group.split(",")} - BIB_KEYS
            assert not unknown, f"{md.name} cites unknown keys {sorted(unknown)}"


if __name__ == "__main__":
    check = "--check" in sys.argv[1:]
    stale = sync_notebooks(check=check)
    for path in stale:
        print(f"{'out of date' if check else 'wrote'}: {path.relative_to(ROOT)}")
    sys.exit(1 if check and stale else 0)


# --------------------------------------------------------------------------------------------
# What a reader sees (the browser test checks the rendered pages; these catch it in the source)
# --------------------------------------------------------------------------------------------

MAX_CODE_LINE = 85  # characters: what the text column shows at 1400 px without scrolling
PLUMBING = re.compile(r"\b(glue|Markdown)\(")


@pytest.mark.parametrize("stem", [*CHAPTERS, "13_grading"])
def test_visible_code_fits_the_column_and_shows_no_plumbing(stem):
    """Code a reader sees teaches: short lines, and no cell that only glues values or builds tables."""
    problems = []
    for cell in jupytext.read(page_source(stem)).cells:
        tags = cell.metadata.get("tags", [])
        if cell.cell_type != "code" or {"remove-input", "remove-cell"} & set(tags):
            continue
        for line in cell.source.splitlines():
            if len(line) > MAX_CODE_LINE:
                problems.append(f"{len(line)} characters: {line.strip()[:60]}")
            if PLUMBING.search(line):
                problems.append(f"plumbing in a shown cell (tag it remove-input): {line.strip()[:60]}")
    assert not problems, f"{stem}.md:\n  " + "\n  ".join(problems)


@pytest.mark.parametrize("stem", [*CHAPTERS, "13_grading"])
def test_chapter_opens_with_its_goals_and_closes_with_a_summary(stem):
    text = page_source(stem).read_text()
    assert re.search(r"In this chapter you will learn|What you will learn", text), (
        f"{stem}.md does not say what the reader will learn")
    heads = re.findall(r"^## (.+?)\s*$", text, re.M)
    assert "Summary" in heads, f"{stem}.md has no '## Summary' section"
    if "Exercises" in heads:
        assert heads.index("Summary") < heads.index("Exercises"), f"{stem}.md: the summary must precede the exercises"


def test_code_excerpts_match_their_source():
    """A listing marked '# excerpt of NAME in PATH' shows only lines that are in PATH (spacing aside)."""
    found = 0
    for md in sorted(BOOK.glob("*.md")):
        for block in re.findall(r"^```python\n(# excerpt of \S+ in (\S+).*?\n.*?)^```", md.read_text(), re.M | re.S):
            body, path = block
            source = re.sub(r"\s+", "", (ROOT / path).read_text())
            for line in body.splitlines()[1:]:
                code = re.sub(r"\s+", "", line.split("  #")[0])
                assert code in source, f"{md.name}: excerpt line not in {path}: {line.strip()}"
            found += 1
    assert found, "no excerpt found: the kernel chapter shows one"


@pytest.mark.parametrize("stem", CHAPTERS)
def test_every_exercise_has_a_title(stem):
    untitled = re.findall(r"^(?:`{3,}|:{3,})\{exercise\}\s*\n:label:\s*(\S+)", page_source(stem).read_text(), re.M)
    assert not untitled, f"{stem}.md: exercises without a title: {untitled}"


def _object_lines(path: Path, name: str) -> list[str]:
    """The source lines of ``name`` (``func`` or ``Class.method``) in ``path``, decorators included."""
    node: ast.AST = ast.parse(path.read_text())
    for part in name.split("."):
        node = next(n for n in ast.walk(node)
                    if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == part)
    start = node.decorator_list[0].lineno if node.decorator_list else node.lineno
    return path.read_text().splitlines()[start - 1:node.end_lineno]


def test_listings_shown_on_a_page_fit_the_column():
    """Package code a chapter shows in full (``literalinclude`` outside a folded dropdown) fits the column."""
    problems, shown = [], 0
    for md in sorted(BOOK.glob("*.md")):
        text = md.read_text()
        folded = [m.span() for m in re.finditer(r"^````\{dropdown\}.*?^````", text, re.M | re.S)]
        for m in re.finditer(r"^```\{(?:literalinclude|graded-listing)\} (\S+)\n((?::\w+:.*\n)*)", text, re.M):
            obj = re.search(r":pyobject:\s*(\S+)", m.group(2))
            if not obj or any(a <= m.start() < b for a, b in folded):
                continue
            dedent = int((re.search(r":dedent:\s*(\d+)", m.group(2)) or [0, 0])[1])
            shown += 1
            for line in _object_lines((md.parent / m.group(1)).resolve(), obj.group(1)):
                if len(line) - dedent > MAX_CODE_LINE + 1:
                    problems.append(f"{md.name} shows {obj.group(1)}: {len(line) - dedent} characters: "
                                    f"{line.strip()[:50]}")
    assert shown, "no listing found"
    assert not problems, "\n".join(problems)


def test_directive_fences_have_no_backticks_in_their_titles():
    """CommonMark ends a backtick fence's info string at a backtick: such a directive renders as text."""
    bad = [f"{md.name}: {line.strip()[:60]}" for md in sorted(BOOK.glob("*.md"))
           for line in md.read_text().splitlines() if re.match(r"^`{3,}\{\w[\w-]*\}.*`", line)]
    assert not bad, "\n".join(bad)
