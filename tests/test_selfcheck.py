"""The self-checks that close every chapter (``self-check``, book/_ext/self_check.py and its script).

Three layers: the chapters' sources (each chapter has a "Self-check" section of 3-5 questions before
its exercises); the directive on a one-page project built here in seconds (it renders, refuses a
malformed question, and in headless Chromium marks a wrong answer wrong and the right one right);
and the built site, where every question of every chapter is answered wrong, then right, with the keyboard
alone (Tab to reach a control, Space or Enter to press it, typing into the number box), offline and without a
console error: ``chapter_self_checks``, run by test_site.py's check of every page on each chapter it has loaded
(a second pass over the chapters would load and typeset each one again). That check audits the answered page
with axe-core as well: the choices are real buttons in list items, each named, the verdict a live region.
"""

from __future__ import annotations

import functools
import http.server
import io
import re
import threading
from pathlib import Path

import nbformat
import pytest
import yaml
from test_site import CHROMIUM, CHROMIUM_ARGS, _QuietHandler, needs_chromium

REPO = Path(__file__).resolve().parents[1]
EXT = REPO / "book" / "_ext"
SELF_CHECK = re.compile(r"^(:{3,})\{self-check\} *(?P<question>.*)\n(?P<options>(?::[\w-]+:.*\n)*)", re.M)


def chapters() -> list[str]:
    """The chapters, from the numbered parts of ``_toc.yml``: every one of them ends with self-checks."""
    toc = yaml.safe_load((REPO / "_toc.yml").read_text())
    return [entry["file"] for part in toc["parts"] if part.get("numbered") for entry in part["chapters"]]


# --------------------------------------------------------------------------------------------
# The chapters' sources
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("chapter", chapters())
def test_chapter_has_a_self_check_section_before_its_exercises(chapter):
    text = (REPO / f"{chapter}.md").read_text()
    heads = re.findall(r"^## (.+?)\s*$", text, re.M)
    assert "Self-check" in heads, f"{chapter}.md has no '## Self-check' section"
    if "Exercises" in heads:
        assert heads.index("Self-check") + 1 == heads.index("Exercises"), (
            f"{chapter}.md: the Self-check section goes just before the Exercises")
    section = text.split("\n## Self-check\n", 1)[1].split("\n## ", 1)[0]
    questions = SELF_CHECK.findall(section)
    assert 3 <= len(questions) <= 5, f"{chapter}.md has {len(questions)} self-checks, not 3-5"
    assert len(SELF_CHECK.findall(text)) == len(questions), f"{chapter}.md: a self-check outside its section"


@pytest.mark.parametrize("chapter", chapters())
def test_number_questions_name_a_key_their_chapter_glues(chapter):
    source = (REPO / f"{chapter}.md").read_text()
    glued = set(re.findall(r"""\bglue\(\s*["']([\w-]+)["']""", source))
    for m in SELF_CHECK.finditer(source):
        key = re.search(r"^:number: *(\S+)", m["options"], re.M)
        if key:
            assert key[1] in glued, f"{chapter}.md: {m['question'][:50]!r} names {key[1]!r}, which no cell glues"


# --------------------------------------------------------------------------------------------
# The directive, on a one-page project
# --------------------------------------------------------------------------------------------

GOOD = """\
:::{self-check} How many key heads does MQA keep?
:answer: 2
- one per query head
- one
- two

All query heads share **one** key head.
:::

:::{self-check} How large is the cache, in GiB?
:number: cache-gib
:format: .1f
:unit: GiB

Two tensors of 2 GiB each.
:::
"""


def notebook(markdown: str, glued: dict[str, object]) -> nbformat.NotebookNode:
    """A one-page notebook with ``glued`` already glued (as ``myst_nb.glue(..., display=False)`` stores it)."""
    prefix = "application/papermill.record/"
    outputs = [nbformat.v4.new_output("display_data", data={f"{prefix}text/plain": repr(v)},
                                      metadata={"scrapbook": {"name": k, "mime_prefix": prefix}})
               for k, v in glued.items()]
    cell = nbformat.v4.new_code_cell("# glue cell", outputs=outputs, metadata={"tags": ["remove-input"]})
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# Page"), cell,
                                         nbformat.v4.new_markdown_cell(markdown)])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    return nb


def build(markdown: str, out: Path, glued: dict[str, object] | None = None) -> tuple[Path, str]:
    """Build a one-page site of ``markdown`` (no execution); return its folder and the build's warnings."""
    from sphinx.application import Sphinx

    src = out / "src"
    src.mkdir(parents=True)
    nbformat.write(notebook(markdown, {"cache-gib": 4.0} if glued is None else glued), src / "index.ipynb")
    (src / "conf.py").write_text(
        f"import sys\nsys.path.insert(0, {str(EXT)!r})\nextensions = ['myst_nb', 'self_check']\n"
        f"html_static_path = [{str(REPO / 'book' / '_static' / 'self-check.js')!r}, "
        f"{str(REPO / 'book' / '_static' / 'self-check.css')!r}]\n"
        "nb_execution_mode = 'off'\nmyst_enable_extensions = ['colon_fence']\n")
    warnings = io.StringIO()
    app = Sphinx(str(src), str(src), str(out / "html"), str(out / ".doctrees"), "html", status=None,
                 warning=warnings, freshenv=True)
    app.build()
    return out / "html", own_warnings(warnings.getvalue())


def own_warnings(log: str) -> str:
    """A Sphinx build's warnings, less those of a second build in one process: Sphinx registers docutils' nodes
    and roles for the whole process, so a build after another (another test's) warns that each is "already
    registered" while setting up the extensions (Sphinx's, myst_nb)."""
    return "\n".join(ln for ln in log.splitlines()
                     if not ("while setting up extension " in ln and "is already registered" in ln))


def test_a_question_renders_with_its_answer_folded(tmp_path):
    html, warnings = build(GOOD, tmp_path)
    page = (html / "index.html").read_text()
    assert not warnings, warnings
    assert '<div class="self-check" data-answer="2" data-kind="choice">' in page
    assert re.search(r'<ol class="[^"]*\bupperalpha\b[^"]*\bself-check-choices">', page)
    assert "<strong>Answer: </strong>B. one</p>" in page
    assert 'data-kind="number" data-shown="4.0" data-tolerance="0.02" data-unit="GiB" data-value="4.0"' in page
    assert "<strong>Answer: </strong>4.0 GiB</p>" in page
    assert page.count('<details class="self-check-answer">') == 2 and "<details open" not in page
    assert "self-check.js" in page and (html / "_static" / "self-check.js").exists()


@pytest.mark.parametrize(("source", "glued", "message"), [
    (":::{self-check} Q?\n- a\n- b\n\nWhy.\n:::\n", {}, "exactly one of :answer:"),
    (":::{self-check} Q?\n:answer: 3\n- a\n- b\n\nWhy.\n:::\n", {}, ":answer: 3 is not one of the 2 choices"),
    (":::{self-check} Q?\n:answer: 1\nWhy first.\n\n- a\n- b\n:::\n", {}, "starts its content with a bullet list"),
    (":::{self-check} Q?\n:answer: 1\n- a\n- b\n:::\n", {}, "needs a why"),
    (":::{self-check} Q?\n:answer: 1\n- a\n\n  more\n- b\n\nWhy.\n:::\n", {}, "each choice of a self-check is one"),
    (":::{self-check} Q?\n:number: nope\n\nWhy.\n:::\n", {}, "No key 'nope' found"),
    (":::{self-check} Q?\n:number: word\n\nWhy.\n:::\n", {"word": "many"}, "is not a number"),
    (":::{self-check} Q?\n:number: x\n:tolerance: 2\n\nWhy.\n:::\n", {"x": 1.0}, "between 0 and 1"),
])
def test_a_malformed_question_is_refused_with_its_reason(tmp_path, source, glued, message):
    html, warnings = build(source, tmp_path, glued)
    assert message in warnings, warnings
    assert 'class="self-check"' not in (html / "index.html").read_text()


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield b
        b.close()


def open_offline(browser, base: str, path: str):
    """A page of ``base`` with requests elsewhere aborted; returns (context, page, errors, blocked)."""
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    blocked: list[str] = []
    errors: list[str] = []

    def only_local(route):
        if route.request.url.startswith((base + "/", "data:")):
            route.continue_()
        else:
            blocked.append(route.request.url)
            route.abort()

    context.route("**/*", only_local)
    page = context.new_page()
    page.on("console", lambda m: errors.append(f"console: {m.text}") if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(f"pageerror: {e}"))
    page.goto(f"{base}/{path}", wait_until="load")
    return context, page, errors, blocked


STATE_JS = """box => {
    const feedback = box.querySelector('.self-check-feedback');
    const details = box.querySelector('details.self-check-answer');
    const choices = [...box.querySelectorAll('ol.self-check-choices > li')].map(li => li.className);
    const answer = details && details.querySelector('p');
    return {question: (box.querySelector('.self-check-question') || {}).innerText || '', choices,
            setUp: Boolean(feedback && details), verdict: feedback && feedback.getAttribute('data-verdict'),
            announced: Boolean(feedback && feedback.getAttribute('aria-live') === 'polite'),
            feedback: feedback && feedback.innerText, open: Boolean(details && details.open),
            answer: answer ? answer.textContent : ''};
}"""  # what a reader sees of one self-check, read in one round trip to the browser

# Which of a self-check's controls has the keyboard's focus: "choice 2" (its third choice's button), "input", "check"
# (the number's Check button), "summary", another element of the box by its tag, or "outside" the box.
FOCUS_JS = """box => {
    const a = document.activeElement;
    if (!box.contains(a)) return 'outside';
    const choices = [...box.querySelectorAll('ol.self-check-choices > li > button')];
    if (choices.includes(a)) return `choice ${choices.indexOf(a)}`;
    if (a.matches('form.self-check-form input')) return 'input';
    if (a.matches('form.self-check-form button')) return 'check';
    return a.tagName.toLowerCase();
}"""
MAX_TABS = 6  # Tab presses allowed from a question's text to its first control (links in the question come first)


def tab_to(page, box, control: str) -> str:
    """Press Tab until ``control`` of ``box`` has the focus; return where the focus is at the end."""
    where = box.evaluate(FOCUS_JS)
    for _ in range(MAX_TABS):
        if where == control:
            break
        page.keyboard.press("Tab")
        where = box.evaluate(FOCUS_JS)
    return where


def walk(page, box, start: int, end: int) -> str:
    """From choice ``start``, press Tab (or Shift+Tab) to choice ``end``, one choice a key; '' or what went wrong."""
    key, step = ("Tab", 1) if end > start else ("Shift+Tab", -1)
    for k in range(start + step, end + step, step):
        page.keyboard.press(key)
        if (where := box.evaluate(FOCUS_JS)) != f"choice {k}":
            return f"{key} from choice {k - step} leads to {where}, not to choice {k}"
    return ""


def answer_every_question(page) -> list[str]:
    """Answer each self-check wrong, then right, with the keyboard alone (Tab, Shift+Tab, Space, Enter and typing,
    as a reader without a mouse does); return what did not behave as it should. The reader's place is set on each
    question's text first, as reading it would leave it; from there only keys are pressed."""
    problems = []
    # element handles, not locators: a locator finds its element again on every call, which costs ten times more
    # than the call itself on a chapter's long page (the self-check script never replaces a box)
    for i, box in enumerate(page.locator("div.self-check").element_handles()):
        box.evaluate("b => { const d = b.querySelector('details.self-check-answer'); if (d) d.open = false; }")
        state = box.evaluate(STATE_JS)  # as a reader finds it, whatever was tried before
        name = f"question {i + 1} ({state['question'][:50]!r})"
        if not state["setUp"]:
            problems.append(f"{name}: not set up (no feedback line or no folded answer)")
            continue
        if not state["announced"]:
            problems.append(f"{name}: the verdict is not a polite live region (aria-live), so it is not read out")
        box.evaluate("b => { const q = b.querySelector('.self-check-question'); q.tabIndex = -1; q.focus(); }")
        if box.get_attribute("data-kind") == "choice":
            right = int(box.get_attribute("data-answer")) - 1
            wrong = 0 if right != 0 else 1
            if (where := tab_to(page, box, "choice 0")) != "choice 0":
                problems.append(f"{name}: Tab does not reach the first choice's button (focus: {where})")
                continue
            if problem := walk(page, box, 0, wrong):
                problems.append(f"{name}: {problem}")
                continue
            page.keyboard.press("Space")
            state = box.evaluate(STATE_JS)
            if "self-check-wrong" not in state["choices"][wrong] or state["verdict"] != "wrong" or state["open"]:
                problems.append(f"{name}: a wrong choice, pressed with Space, is not marked wrong")
            if problem := walk(page, box, wrong, right):
                problems.append(f"{name}: {problem}")
                continue
            page.keyboard.press("Enter")
            state = box.evaluate(STATE_JS)
            if "self-check-right" not in state["choices"][right] or "self-check-wrong" in state["choices"][wrong]:
                problems.append(f"{name}: the right choice, pressed with Enter, is not marked right")
        else:
            shown = float(box.get_attribute("data-shown"))
            if (where := tab_to(page, box, "input")) != "input":
                problems.append(f"{name}: Tab does not reach the answer box (focus: {where})")
                continue
            page.keyboard.type(repr(2 * shown + 1))
            page.keyboard.press("Enter")
            state = box.evaluate(STATE_JS)
            if state["verdict"] != "wrong" or state["open"]:
                problems.append(f"{name}: {2 * shown + 1} is not marked wrong")
            page.keyboard.press("ControlOrMeta+A")
            page.keyboard.type(state["answer"].split(": ", 1)[1].split()[0])
            page.keyboard.press("Tab")
            if (where := box.evaluate(FOCUS_JS)) != "check":
                problems.append(f"{name}: Tab from the answer box leads to {where}, not to its Check button")
                continue
            page.keyboard.press("Space")
            state = box.evaluate(STATE_JS)
        if state["verdict"] != "right" or state["feedback"] != "Right.":
            problems.append(f"{name}: the right answer is not marked right ({state['feedback']!r})")
        if not state["open"]:
            problems.append(f"{name}: the answer and why stay folded after a right answer")
    return problems


def chapter_self_checks(page, chapter: str) -> list[str]:
    """What is wrong with the self-checks of a built chapter's page (``book/NN_name.html``) open in ``page``: one
    shown for each written in its source, each marked wrong, then right (``answer_every_question``). The site's
    check, ``test_site.Pages.test_pages_render_offline``, calls it on every chapter it has loaded."""
    written = len(SELF_CHECK.findall((REPO / chapter).with_suffix(".md").read_text()))
    count = page.locator("div.self-check").count()
    problems = [] if count == written else [f"{count} self-checks shown of {written} written (see the build log)"]
    return problems + answer_every_question(page)


def serve(folder: Path):
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_QuietHandler, directory=str(folder)))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd, f"http://127.0.0.1:{httpd.server_address[1]}"


@needs_chromium
def test_wrong_answers_are_marked_wrong_and_right_ones_right(tmp_path, browser):
    html, _ = build(GOOD, tmp_path)
    httpd, base = serve(html)
    try:
        context, page, errors, blocked = open_offline(browser, base, "index.html")
        choice, number = page.locator("div.self-check").nth(0), page.locator("div.self-check").nth(1)
        # each choice is a button inside its list item, named by its letter and text
        assert choice.locator("ol > li > button").count() == 3
        choice.get_by_role("button", name="C. two", exact=True).click()
        assert "self-check-wrong" in choice.locator("li").nth(2).get_attribute("class")
        assert choice.get_by_role("status").inner_text() == "Not this one (C): try another, or show the answer."
        choice.get_by_role("button", name="B. one", exact=True).click()
        assert "self-check-right" in choice.locator("li").nth(1).get_attribute("class")
        assert choice.get_by_role("status").inner_text() == "Right."
        assert choice.locator("details").evaluate("d => d.open")
        field = number.get_by_role("textbox", name="Your answer, in GiB")
        for typed, verdict, said in [("four", "none", "Enter a number"), ("3.95", "right", "Right."),
                                     ("4.5", "wrong", "Not quite: 4.5 is too high"),
                                     ("3.5", "wrong", "Not quite: 3.5 is too low"), ("4", "right", "Right.")]:
            field.fill(typed)
            field.press("Enter")
            assert number.locator(".self-check-feedback").get_attribute("data-verdict") == verdict, typed
            assert number.locator(".self-check-feedback").inner_text().startswith(said), typed
        assert answer_every_question(page) == []
        context.close()
        assert not errors and not blocked, (errors, blocked)
    finally:
        httpd.shutdown()
        httpd.server_close()


@needs_chromium
def test_the_checker_notices_questions_that_do_not_answer(tmp_path, browser):
    """Guard against a vacuous pass: without the script, no question may pass ``answer_every_question``."""
    html, _ = build(GOOD, tmp_path)
    page = (html / "index.html").read_text()
    (html / "index.html").write_text(re.sub(r'<script[^>]*self-check\.js[^>]*></script>', "", page))
    httpd, base = serve(html)
    try:
        context, page, _, _ = open_offline(browser, base, "index.html")
        problems = answer_every_question(page)
        context.close()
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert len(problems) == 2 and all("not set up" in p for p in problems), problems
