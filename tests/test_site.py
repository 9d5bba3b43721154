"""The built site, checked page by page in headless Chromium, with the network cut off.

The book is built once per session (``built_site`` in conftest.py), served from ``_build/html`` on
127.0.0.1, and every HTML page is loaded. Any other host is unreachable from the browser (a request to one fails
and is reported), so the check also proves the site works offline (MathJax and mermaid are vendored in
``book/_static/vendor``). The pages share one browser context (and so its HTTP cache) and are read one after
another in one tab, each a new document that starts with no cookies and empty storage, as in a fresh context.
Pages are read at 1280 px, where the layout checks apply: no code, output, table or display equation
wider than its column, no raw LaTeX or build plumbing in the text or in any link's text, a summary in
every chapter and a numbered caption under every figure. Text inside figures is at least 10 pt as
displayed: ``mha_lab.plots`` checks each figure's text (and that its tick labels do not overlap) at
its natural size when it saves it, and this test checks that no figure is shown smaller than that;
the mermaid diagrams are checked here, for text size and overlapping labels. Every page is audited for
accessibility (WCAG 2.0 and 2.1, levels A and AA) by axe-core, vendored in ``tests/vendor``: any serious or
critical violation fails it. Screenshots land in
``_build/screenshots/``: the home, notation and first chapter pages, and chapters 2 and 3 and
the tensor-parallel chapter at 1280 px and at phone width.
"""

from __future__ import annotations

import functools
import http.server
import re
import threading
from collections.abc import Callable
from html.parser import HTMLParser
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import pytest

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--disable-quic",
]
# The site's browser reaches this machine only: a request to any other host fails at once, in the browser, rather
# than through a route (intercepting requests would also turn off the HTTP cache the pages share)
OFFLINE_ARGS = ["--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1"]
# run first in every document of the shared context, so that no page sees what a page before it stored
FRESH_STORAGE_JS = "try { localStorage.clear(); sessionStorage.clear(); } catch (e) {}"
WIDTH = 1280
PHONE_WIDTH = 390  # the phone look: the page as loaded at WIDTH, narrowed to this
HEIGHT = 900
SCREENSHOT_PAGES = ["book/intro.html", "book/notation.html", "book/01_intuition.html", "book/02_math.html",
                    "book/03_reshape.html", "book/11_tensor_parallel.html"]
PHONE_SCREENSHOT_PAGES = ["book/02_math.html", "book/03_reshape.html", "book/11_tensor_parallel.html"]
CHAPTER = re.compile(r"book/\d\d_\w+\.html")
AXE = Path(__file__).resolve().parent / "vendor" / "axe-core" / "axe.min.js"
AXE_TAGS = ["wcag2a", "wcag2aa", "wcag21a", "wcag21aa"]  # WCAG 2.1 AA: the rules of levels A and AA, 2.0 and 2.1
AXE_BLOCKING = ("serious", "critical")  # axe's impacts that fail the check; "minor" and "moderate" do not
SKIP_DIRS = {"_static", "_sources", "_images", "_downloads"}

needs_chromium = pytest.mark.skipif(
    not CHROMIUM.exists(),
    reason="the browser check needs Chromium at /usr/bin/chromium: apt-get install chromium (.ci/run does)",
)

# Page-side checks, run after MathJax and mermaid have finished. Code blocks and MathJax's own
# output are removed first, so that a `$$` shown as code does not count as untypeset math.
PAGE_REPORT_JS = """
() => {
  const article = document.querySelector('article') || document.body;
  const clone = article.cloneNode(true);
  clone.querySelectorAll('pre, code, script, style, mjx-container, .mermaid, .highlight').forEach(e => e.remove());
  const text = clone.innerText;
  const raw = [];
  for (const token of ['$$', '\\\\(', '\\\\[', '\\\\begin{']) { if (text.includes(token)) raw.push(token); }
  const mathNodes = [...document.querySelectorAll('.math')];
  const h1 = document.querySelector('article h1') || document.querySelector('main h1');
  return {
    title: document.title,
    h1: h1 ? h1.innerText.replace(/#\\s*$/, '').trim() : null,
    h1Visible: h1 ? h1.getBoundingClientRect().height > 0 : false,
    raw,
    mathNodes: mathNodes.length,
    untypeset: mathNodes.filter(e => !e.querySelector('mjx-container')).map(e => e.textContent.slice(0, 80)),
    images: [...document.images].map(i => ({src: i.currentSrc || i.src, ok: i.complete && i.naturalWidth > 0})),
    mermaid: [...document.querySelectorAll('.mermaid')].map(e => !!e.querySelector('svg')),
    links: [...document.querySelectorAll('a[href]')].map(a => a.href),
  };
}
"""


# The layout and presentation checks, run on the same page: what a reader should never see (TeX source,
# the cells that only glue values or build tables, error output), what must not overflow the column at
# this width, a Summary in every chapter, a numbered caption under every figure, figures as SVG.
LAYOUT_REPORT_JS = r"""
() => {
  const article = document.querySelector('article') || document.body;
  const clone = article.cloneNode(true);
  clone.querySelectorAll('pre, code, script, style, mjx-container, .mermaid, .highlight').forEach(e => e.remove());
  const text = clone.innerText;
  return {
    // what a reader should never see: TeX source, and the cells that only glue values or build tables
    rawTex: ['$', '\\_'].filter(t => text.includes(t)).map(t => {
      const i = text.indexOf(t); return text.slice(Math.max(0, i - 30), i + 30).replace(/\s+/g, ' ');
    }),
    plumbing: [...article.querySelectorAll('.cell_input, div.highlight, pre')]
      .map(e => e.textContent).filter(t => /\b(glue|Markdown)\(/.test(t))
      .map(t => t.split('\n').find(l => /\b(glue|Markdown)\(/.test(l)).trim().slice(0, 80)),
    // layout at this width: blocks and tables that do not fit their column
    wideBlocks: [...article.querySelectorAll('pre')]
      .filter(e => !e.closest('details:not([open])') && e.getClientRects().length)  // shown, not folded
      .filter(e => e.scrollWidth > e.clientWidth + 1)
      .map(e => `${e.scrollWidth - e.clientWidth} px too wide: ${e.textContent.split('\n')
        .reduce((a, b) => b.length > a.length ? b : a, '').trim().slice(0, 60)}`),
    wideTables: [...article.querySelectorAll('table')].filter(t => {
      const box = t.parentElement;  // the theme wraps each table in a box that scrolls
      return t.scrollWidth > t.clientWidth + 1 || t.getBoundingClientRect().width > box.clientWidth + 1;
    }).map(t => (t.querySelector('tr') || t).innerText.replace(/\s+/g, ' ').slice(0, 60)),
    // link texts (table of contents, cross-references, navigation) that show TeX source
    texLinks: [...document.querySelectorAll('a')].map(a => {
      const c = a.cloneNode(true); c.querySelectorAll('mjx-container, script').forEach(e => e.remove());
      return c.textContent.replace(/\s+/g, ' ').trim();
    }).filter(t => /\\[A-Za-z]+|\$|\^\{|_\{/.test(t)),
    wideMath: [...article.querySelectorAll('mjx-container[display="true"]')]
      .filter(m => m.getClientRects().length && m.scrollWidth > m.clientWidth + 1)
      .map(m => `${m.scrollWidth - m.clientWidth} px too wide, under "${(m.closest('section') &&
        m.closest('section').querySelector('h1, h2, h3') || {innerText: '?'}).innerText.trim().slice(0, 50)}"`),
    // a figure shown narrower than its natural size: its text, checked at that size, is then below 10 pt
    shrunkFigures: [...article.querySelectorAll('.cell_output img, figure img')]
      .filter(i => i.naturalWidth && i.getClientRects().length && i.clientWidth < i.naturalWidth - 1)
      .map(i => `${i.src.split('/').pop()} at ${Math.round(100 * i.clientWidth / i.naturalWidth)}%`),
    // mermaid diagrams: text size as displayed (the SVG is scaled to its box) and labels that overlap
    diagrams: [...article.querySelectorAll('.mermaid svg')].map(svg => {
      const view = svg.viewBox && svg.viewBox.baseVal;
      const scale = view && view.width ? svg.getBoundingClientRect().width / view.width : 1;
      const labels = [...svg.querySelectorAll('.nodeLabel, .edgeLabel .label span, .edgeLabel p, text')]
        .filter(e => e.textContent.trim() && !e.querySelector('.nodeLabel, p, span'));
      const px = Math.min(...labels.map(e => parseFloat(getComputedStyle(e).fontSize) * scale));
      const boxes = labels.map(e => [e.textContent.trim(), e.getBoundingClientRect()]);
      const overlaps = [];
      boxes.forEach(([a, r], i) => boxes.slice(i + 1).forEach(([b, q]) => {
        if (Math.min(r.right, q.right) - Math.max(r.left, q.left) > 1 &&
            Math.min(r.bottom, q.bottom) - Math.max(r.top, q.top) > 1) {
          overlaps.push(`${a.slice(0, 25)} / ${b.slice(0, 25)}`);
        }
      }));
      return {minPt: px * 72 / 96, overlaps};
    }),
    crushedCells: [...article.querySelectorAll('td, th')].filter(c => c.scrollWidth > c.clientWidth + 1)
      .map(c => c.innerText.trim().slice(0, 30)),
    rawFloats: [...article.querySelectorAll('.cell_output pre, .cell_output td')].map(e => e.textContent)
      .map(t => (t.match(/-?\d+\.\d{7,}(e[-+]?\d+)?/) || [null])[0]).filter(Boolean),
    errors: [...article.querySelectorAll('.output.error, .output.traceback')].map(e => e.innerText.slice(0, 120)),
    // section titles without their number ("4.7. Summary" -> "Summary")
    headings: [...article.querySelectorAll('h2')]
      .map(e => e.innerText.replace(/#\s*$/, '').trim().replace(/^\d+(\.\d+)*\.\s*/, '')),
    uncaptioned: [...article.querySelectorAll('img')].filter(i => {
      const caption = i.closest('figure') && i.closest('figure').querySelector('figcaption');
      return !caption || !/^(Fig|Figure)\.? ?\d+\.\d+/.test(caption.innerText.trim());
    }).map(i => i.src.split('/').pop()),
    rasterFigures: [...article.querySelectorAll('.cell_output img')].filter(i => !/\.svg$/.test(i.src))
      .map(i => i.src.split('/').pop()),
  };
}
"""


MERMAID_DONE_JS = "() => [...document.querySelectorAll('.mermaid')].every(e => e.querySelector('svg'))"


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):  # keep pytest's output readable
        pass


@pytest.fixture(scope="module")
def server(built_site: Path):
    handler = functools.partial(_QuietHandler, directory=str(built_site))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS + OFFLINE_ARGS)
        yield b
        b.close()


def site_context(browser):
    """A browser context for checking many pages one after another (``check_page``): they share its HTTP cache,
    and each starts with no cookies and empty storage, as in a context of its own."""
    context = browser.new_context(viewport={"width": WIDTH, "height": HEIGHT})
    context.add_init_script(FRESH_STORAGE_JS)
    return context


@pytest.fixture(scope="module")
def site(browser):
    """The context in which this module's tests read the built site (``site_context``), shared by all of them."""
    context = site_context(browser)
    yield context
    context.close()


def site_pages(root: Path) -> list[str]:
    """Every HTML page of the site, relative to its root, except the copied sources and assets."""
    return sorted(
        p.relative_to(root).as_posix()
        for p in root.rglob("*.html")
        if not SKIP_DIRS & set(p.relative_to(root).parts)
    )


class _Ids(HTMLParser):
    def __init__(self):
        super().__init__()
        self.ids: set[str] = set()

    def handle_starttag(self, tag, attrs):
        for key, value in attrs:
            if key in ("id", "name") and value:
                self.ids.add(value)


@functools.cache
def anchors_of(path: Path) -> frozenset[str]:
    parser = _Ids()
    parser.feed(path.read_text(errors="replace"))
    return frozenset(parser.ids)


def broken_links(links: list[str], base: str, root: Path) -> list[str]:
    """Local links whose file does not exist, or whose #anchor is not an id on the target page."""
    broken = []
    for href in sorted(set(links)):
        if not href.startswith(base + "/"):
            continue  # another host (launch buttons, papers): not part of this site
        parts = urlsplit(href)
        target = root / unquote(parts.path).lstrip("/")
        if target.is_dir():
            target = target / "index.html"
        if not target.is_file():
            broken.append(f"{href} (no such file)")
        elif parts.fragment and target.suffix == ".html" and unquote(parts.fragment) not in anchors_of(target):
            broken.append(f"{href} (no anchor #{unquote(parts.fragment)})")
    return broken


# axe-core's audit of the page as it stands, reduced to what the report prints: each rule broken, its impact, and the
# elements that break it (as CSS selectors)
AXE_RUN_JS = """tags => axe.run(document, {runOnly: {type: 'tag', values: tags}, resultTypes: ['violations']})
  .then(r => r.violations.map(v => ({id: v.id, impact: v.impact, help: v.help,
                                     targets: v.nodes.map(n => n.target.join(' '))})))"""


def accessibility_problems(page) -> list[str]:
    """The serious and critical WCAG 2.1 A/AA violations axe-core finds on ``page``, one line per rule broken."""
    page.add_script_tag(path=str(AXE))
    violations = page.evaluate(AXE_RUN_JS, AXE_TAGS)
    return [f"accessibility (axe-core {v['id']}, {v['impact']}): {v['help']}: {len(v['targets'])} element(s), "
            f"e.g. {', '.join(v['targets'][:3])}" for v in violations if v["impact"] in AXE_BLOCKING]


def check_page(context, base: str, root: Path, page_path: str, screenshot: Path | None,
               render_timeout_ms: int = 20_000, then: Callable[[Any], list[str]] | None = None,
               audit: bool = True, phone: Path | None = None) -> list[str]:
    """Load one page offline at ``WIDTH`` px, in the tab that ``context`` (``site_context``) keeps for them, and
    return the list of problems found on it, with those ``then`` finds when it is handed the page after the checks
    (and the screenshot), and, with ``audit``, those axe-core finds on the page as ``then`` leaves it (self-checks
    answered, their answers open). With ``phone``, the page as loaded is first narrowed to ``PHONE_WIDTH`` px,
    checked again (all but the sizing rules, which are for the desktop width: at that width this is a look) and shot
    into ``phone``, then widened back for ``then``. The page is left for a blank one at the end: one tab, and so one
    renderer process, reads page after page (about half the CPU of a tab each, mostly scripts compiled once), each
    page a new document that starts with no cookies and empty storage; a tab that failed a check is closed, and the
    next page gets a new one."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    context.clear_cookies()
    page = next((p for p in context.pages if p.url == "about:blank"), None) or context.new_page()
    blocked: list[str] = []
    errors: list[str] = []
    listeners = {
        "request": lambda r: None if r.url.startswith((base + "/", "data:", "blob:")) else blocked.append(r.url),
        "console": lambda m: errors.append(f"console: {m.text}") if m.type == "error" else None,
        "pageerror": lambda e: errors.append(f"pageerror: {e}"),
        "response": lambda r: errors.append(f"HTTP {r.status}: {r.url}") if r.status >= 400 else None,
    }
    for event, listener in listeners.items():
        page.on(event, listener)
    done = False
    try:
        page.goto(f"{base}/{page_path}", wait_until="load")
        redirect = re.search(r'http-equiv="refresh" content="\d+;\s*url=([^"]+)"', (root / page_path).read_text(), re.I)
        if redirect:  # the root index.html forwards to the home page: check where it lands
            page.wait_for_url(f"{base}/{redirect.group(1)}")
            page.wait_for_load_state("load")
        # MathJax typesets asynchronously; mermaid renders on window load.
        page.wait_for_function("() => !window.MathJax || (window.MathJax.startup && window.MathJax.startup.promise)")
        page.evaluate("() => window.MathJax ? window.MathJax.startup.promise : null")
        try:  # a diagram that never renders is reported below, with everything else
            page.wait_for_function(MERMAID_DONE_JS, timeout=render_timeout_ms)
        except PlaywrightTimeout:
            pass
        page.evaluate("() => Promise.all([...document.images].map(i => i.decode().catch(() => null)))")
        report = page.evaluate(PAGE_REPORT_JS) | page.evaluate(LAYOUT_REPORT_JS)
        if screenshot is not None:
            page.screenshot(path=str(screenshot), full_page=True)
        if phone is not None:
            page.set_viewport_size({"width": PHONE_WIDTH, "height": HEIGHT})
            phone_report = page.evaluate(PAGE_REPORT_JS) | page.evaluate(LAYOUT_REPORT_JS)
            page.screenshot(path=str(phone), full_page=True)
            page.set_viewport_size({"width": WIDTH, "height": HEIGHT})
        found = then(page) if then is not None else []
        found += accessibility_problems(page) if audit else []
        done = True
    except Exception as exc:  # a timeout names the step that never finished
        return [f"{type(exc).__name__}: {str(exc).splitlines()[0]}"] + errors + [f"blocked {u}" for u in blocked]
    finally:
        for event, listener in listeners.items():
            page.remove_listener(event, listener)
        if done:
            page.goto("about:blank")
        else:
            page.close()

    problems = list(errors) + found
    problems += [f"request to another host (the site must work offline): {u}" for u in blocked]
    problems += report_problems(report, base, root, page_path, WIDTH)
    if phone is not None:
        sizing = ("wider than the column", "too narrow", "below its natural size", "pt as displayed")
        narrow = report_problems(phone_report, base, root, page_path, PHONE_WIDTH)
        problems += [f"at {PHONE_WIDTH} px: {p}" for p in narrow
                     if p not in problems and not any(s in p for s in sizing)]
    return problems


def report_problems(report: dict, base: str, root: Path, page_path: str, width: int) -> list[str]:
    """The problems that the page-side reports (``PAGE_REPORT_JS``, ``LAYOUT_REPORT_JS``) of ``page_path``, read at
    ``width`` px, show."""
    problems = []
    if not report["title"] or not report["h1"] or not report["h1Visible"]:
        problems.append(f"no visible title (title={report['title']!r}, h1={report['h1']!r})")
    elif report["h1"] not in report["title"] and page_path != "index.html":
        problems.append(f"the <title> {report['title']!r} does not show the heading {report['h1']!r}")
    if report["raw"]:
        problems.append(f"raw math delimiters left in the text: {report['raw']}")
    if report["untypeset"]:
        problems.append(f"math not typeset by MathJax: {report['untypeset'][:3]}")
    problems += [f"image did not load: {i['src'][:120]}" for i in report["images"] if not i["ok"]]
    if not all(report["mermaid"]):
        problems.append(f"{report['mermaid'].count(False)} mermaid diagram(s) not rendered to SVG")
    problems += [f"broken link: {b}" for b in broken_links(report["links"], base, root)]
    problems += [f"TeX source shown as text: ...{t}..." for t in report["rawTex"]]
    problems += [f"build plumbing on the page (make the cell remove-input): {t}" for t in report["plumbing"]]
    problems += [f"code or output wider than the column at {width} px: {t}" for t in report["wideBlocks"]]
    problems += [f"table wider than the column at {width} px: {t}" for t in report["wideTables"]]
    problems += [f"display equation wider than the column at {width} px: {t}" for t in report["wideMath"]]
    problems += [f"raw LaTeX in a link's text: {t!r}" for t in report["texLinks"]]
    problems += [f"figure shown below its natural size, so its text falls under 10 pt: {t}"
                 for t in report["shrunkFigures"]]
    for i, d in enumerate(report["diagrams"], 1):
        if d["minPt"] < 10 - 0.05:
            problems.append(f"diagram {i}: text of {d['minPt']:.1f} pt as displayed (at least 10 pt)")
        problems += [f"diagram {i}: labels overlap: {o}" for o in d["overlaps"][:3]]
    problems += [f"table cell too narrow for its content: {t!r}" for t in report["crushedCells"][:5]]
    problems += [f"error output on the page: {t}" for t in report["errors"]]
    problems += [f"unrounded number in an output (round it to what it means): {t}" for t in report["rawFloats"]]
    problems += [f"figure without a numbered caption: {t}" for t in report["uncaptioned"]]
    problems += [f"figure is a raster image, not SVG: {t}" for t in report["rasterFigures"]]
    if CHAPTER.fullmatch(page_path):
        heads = report["headings"]
        if "Summary" not in heads:
            problems.append(f"chapter without a Summary section (sections: {heads})")
        elif "Exercises" in heads and heads.index("Summary") > heads.index("Exercises"):
            problems.append("the Summary comes after the Exercises")
    return problems


SHARES = 2  # the pages are checked in this many units (a class each), which pytest-xdist hands to its workers


class Pages:
    """The checks of one share of the site's pages (every ``SHARES``-th page from ``SHARE``): a class per share,
    so that once the book is built its pages are checked on every core."""

    SHARE = 0

    @needs_chromium
    def test_pages_render_offline(self, built_site: Path, server: str, site):
        """Each page: title shown, math typeset, images loaded, diagrams drawn, no errors, links resolve; on each
        chapter, every self-check answered wrong, then right (``test_selfcheck.chapter_self_checks``)."""
        from test_selfcheck import chapter_self_checks, chapters  # that module imports this one's fixtures

        every = site_pages(built_site)
        assert "book/intro.html" in every and len(every) >= 4, f"the build produced too few pages: {every}"
        with_self_checks = {f"{c}.html" for c in chapters()}
        assert with_self_checks <= set(every), sorted(with_self_checks - set(every))
        pages = every[self.SHARE::SHARES]
        shots = built_site.parent / "screenshots"
        shots.mkdir(exist_ok=True)
        names = {p: re.sub(r"\W", "_", p.removesuffix(".html")) for p in pages}
        for page_path in pages:  # this run's shots only; folders beside them (kept for comparison) stay
            for old in (shots / f"{names[page_path]}.png", shots / f"{names[page_path]}_phone.png"):
                old.unlink(missing_ok=True)
        failures = {}
        for page_path in pages:
            shot = shots / f"{names[page_path]}.png" if page_path in SCREENSHOT_PAGES else None
            phone = shots / f"{names[page_path]}_phone.png" if page_path in PHONE_SCREENSHOT_PAGES else None
            then = functools.partial(chapter_self_checks, chapter=page_path) if page_path in with_self_checks else None
            problems = check_page(site, server, built_site, page_path, shot, then=then, phone=phone)
            if problems:
                failures[page_path] = problems
        report = "\n".join(f"{page}:\n  " + "\n  ".join(p) for page, p in failures.items())
        assert not failures, f"{len(failures)} of {len(pages)} pages have problems:\n{report}"
        expected = sorted([f"{names[p]}.png" for p in pages if p in SCREENSHOT_PAGES]
                          + [f"{names[p]}_phone.png" for p in pages if p in PHONE_SCREENSHOT_PAGES])
        taken = sorted(p.name for p in shots.glob("*.png") if p.name in expected)
        assert taken == expected, f"expected the screenshots {expected}, got {taken}"


class TestPagesShare1(Pages):
    SHARE = 0


class TestPagesShare2(Pages):
    SHARE = 1


def test_every_page_is_in_a_share():
    assert sorted(c.SHARE for c in Pages.__subclasses__()) == list(range(SHARES))


@needs_chromium
def test_math_and_diagrams_are_really_there(built_site: Path, server: str, site):
    """Guard against a vacuous pass: the notation page has math and two diagrams, and they render."""
    page = site.new_page()
    page.goto(f"{server}/book/notation.html", wait_until="load")
    page.evaluate("() => window.MathJax.startup.promise")
    page.wait_for_function("() => document.querySelectorAll('.mermaid svg').length >= 2", timeout=20_000)
    assert page.locator("mjx-container").count() >= 20, "MathJax typeset too little of the notation page"
    assert page.locator(".mermaid svg").count() == 2, "the forward and backward diagrams must both render"
    assert "grad_X" in page.locator(".mermaid").nth(1).inner_text()
    page.close()


BROKEN_PAGE = """<!DOCTYPE html><html><head><title>Broken</title>
<style>@media (max-width: 500px) { h1 { display: none } }</style></head><body><article>
<h1>Broken</h1>
<p>Raw math: $$x^2$$</p>
<img src="missing.png">
<img src="https://example.org/remote.png">
<div class="mermaid">graph TD; A-->B</div>
<a href="nowhere.html">a dead link</a>
<p>Left as source: $O(n^2)$ and BLOCK\\_M.</p>
<div class="cell_input"><pre>glue("x", 1, display=False)</pre></div>
<pre style="width: 300px; overflow-x: auto">x = 1  # a comment that runs far, far past the edge of its column</pre>
<div style="width: 300px"><table><tr><td>a</td><td>a_cell_that_will_not_wrap_anywhere_at_all_ever</td></tr>
</table></div>
<div class="output error"><pre>FigureStyleError: text below 10 px</pre></div>
<div class="cell_output"><pre>max |wrong - right| = 8.881784197001252e-16</pre></div>
<figure><img src="plot.png"><figcaption>no number</figcaption></figure>
<a href="#top">without the L \\times L matrix</a>
<div style="width: 300px"><figure><img style="max-width: 100%"
  src="data:image/svg+xml,%3Csvg xmlns='http://www.w3.org/2000/svg' width='600' height='40'%3E%3C/svg%3E">
  <figcaption>Fig. 1.1 A figure squeezed to half its size</figcaption></figure></div>
<div class="mermaid"><svg viewBox="0 0 1000 100" width="300" height="30">
  <text x="10" y="50" font-size="16">a label</text><text x="14" y="52" font-size="16">on a label</text></svg></div>
<mjx-container display="true" style="display: block; width: 200px; overflow: hidden">
  <span style="display: inline-block; width: 500px">x</span></mjx-container>
<ol><li role="button" tabindex="0">a choice that is not a list item</li></ol>
<p style="color: #999; background: #fff">grey on white, 2.8:1</p>
<script>throw new Error("boom");</script>
</article></body></html>"""


@needs_chromium
def test_checker_reports_every_kind_of_problem(tmp_path: Path, browser):
    """The page checker itself, on a page that breaks every rule: nothing may pass unnoticed."""
    (tmp_path / "broken.html").write_text(BROKEN_PAGE)
    handler = functools.partial(_QuietHandler, directory=str(tmp_path))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{httpd.server_address[1]}"
        phone = tmp_path / "phone.png"
        context = site_context(browser)
        problems = "\n".join(check_page(context, base, tmp_path, "broken.html", None, render_timeout_ms=1000,
                                         phone=phone))
        context.close()
    finally:
        httpd.shutdown()
        httpd.server_close()
    for expected in ["pageerror: boom", "HTTP 404", "request to another host", "raw math delimiters",
                     "image did not load", "mermaid diagram(s) not rendered", "broken link",
                     "TeX source shown as text", "build plumbing on the page", "code or output wider than the column",
                     "table wider than the column", "error output on the page", "figure without a numbered caption",
                     "unrounded number in an output", "raw LaTeX in a link's text",
                     "figure shown below its natural size", "diagram 1: text of 3.6 pt", "diagram 1: labels overlap",
                     "display equation wider than the column", "accessibility (axe-core image-alt, critical)",
                     "accessibility (axe-core list, serious)", "accessibility (axe-core color-contrast, serious)"]:
        assert expected in problems, f"the checker missed {expected!r}; it reported:\n{problems}"
    # the phone look: the page checked again at phone width (where its heading is hidden), and shot at that width
    assert f"at {PHONE_WIDTH} px: no visible title" in problems, problems
    assert "no visible title" not in problems.replace(f"at {PHONE_WIDTH} px: no visible title", ""), problems
    shot_width = int.from_bytes(phone.read_bytes()[16:20], "big")  # the PNG's IHDR; this page's overflow widens it
    assert PHONE_WIDTH <= shot_width < WIDTH, f"the phone screenshot is {shot_width} px wide"


# Sphinx warnings that mean a reader would meet broken content: a cross-reference or citation rendered as
# plain text, a glued number that failed to format, a missing image. A download of an assignment that
# is not released yet is allowed (the grading page says so), and so are the kernel's own log lines.
BROKEN_CONTENT = re.compile(
    r"WARNING: (undefined label|unknown document|.*reference target not found|could not find bibtex key"
    r"|.*citation.*not found|Failed to format|image file not readable|Unknown (directive|interpreted text role)"
    r"|duplicate label|.*does not exist in the toc|toctree contains reference to nonexisting)"
)


def test_build_has_no_broken_references(built_site: Path):
    log = built_site.parent / "book_build.log"
    assert log.exists(), "the build log is missing"
    broken = sorted({line.strip() for line in log.read_text().splitlines() if BROKEN_CONTENT.search(line)})
    assert not broken, "make book warned about broken content:\n" + "\n".join(broken)


def test_broken_links_are_detected(tmp_path: Path):
    """The link checker itself: a missing file and a missing anchor are both reported."""
    (tmp_path / "a.html").write_text('<html><body><h1 id="top">A</h1></body></html>')
    base = "http://127.0.0.1:1"
    links = [f"{base}/a.html#top", f"{base}/a.html#nope", f"{base}/b.html", "https://example.org/x"]
    assert broken_links(links, base, tmp_path) == [
        f"{base}/a.html#nope (no anchor #nope)",
        f"{base}/b.html (no such file)",
    ]
