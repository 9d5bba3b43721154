"""The class report (``mha_lab.instructor.report``) and the similarity of answers (``...similarity``).

No grading here: the small class's gradebook rows and autograded notebooks are written directly, and the
similarity is computed on answers written for this test. (The report on the graded class of mutants is
checked in ``test_grading_pipeline.py``, which grades that class anyway.)
"""

from __future__ import annotations

import ast
import contextlib
import csv
import html
import io
import re
import shutil
import tokenize
from datetime import datetime, timedelta
from pathlib import Path

import nbformat
import numpy as np
import pytest
from test_site import CHROMIUM, CHROMIUM_ARGS, needs_chromium

from mha_lab.grading import checks, course, judge
from mha_lab.instructor import report, similarity
from mha_lab.instructor.classroom import REPO, answer_cell, read_notebook

PS3 = "ps3_memory_efficient"
TASKS = ("measure_peak", "head_by_head_forward", "chunked_attention")

# --- two correct ps3 solutions, written independently of each other and of the reference ---------------

LOOPS = {  # helper functions, plain loops, names spelt out
    "measure_peak": '''\
def measure_peak(fn, *args, **kwargs):
    """Run ``fn(*args, **kwargs)`` once under tracemalloc; return ``(result, peak_bytes)``."""
    already_tracing = tracemalloc.is_tracing()
    if not already_tracing:
        tracemalloc.start()
    tracemalloc.reset_peak()
    value = fn(*args, **kwargs)
    highest = tracemalloc.get_traced_memory()[1]
    if not already_tracing:
        tracemalloc.stop()
    return value, highest
''',
    "head_by_head_forward": '''\
import math


def _attend_one_head(x, wq, wk, wv, mask):
    queries, keys, values = x @ wq, x @ wk, x @ wv
    logits = np.matmul(queries, np.swapaxes(keys, 1, 2)) / math.sqrt(wq.shape[1])
    if mask is not None:
        logits += mask
    logits -= np.max(logits, axis=2, keepdims=True)
    np.exp(logits, out=logits)
    logits /= np.sum(logits, axis=2, keepdims=True)
    return np.matmul(logits, values)


def head_by_head_forward(X, W_Q, W_K, W_V, W_O, num_heads, mask=None):
    """Multi-head attention computed one head at a time; equals the fused layer's output."""
    width = X.shape[2] // num_heads
    result = None
    for head in range(num_heads):
        lo, hi = head * width, head * width + width
        part = _attend_one_head(X, W_Q[:, lo:hi], W_K[:, lo:hi], W_V[:, lo:hi], mask) @ W_O[lo:hi, :]
        result = part if result is None else result + part
    return result
''',
    "chunked_attention": '''\
def _merge_tile(state, scores, values):
    best, total, weighted = state
    new_best = np.maximum(best, np.max(scores, axis=-1, keepdims=True))
    shrink = np.exp(best - new_best)
    probs = np.exp(scores - new_best)
    return new_best, total * shrink + np.sum(probs, axis=-1, keepdims=True), weighted * shrink + probs @ values


def chunked_attention(Q, K, V, block_size, causal=False):
    """Exact attention computed tile by tile with an online softmax; no L x L matrix is formed."""
    length, dim = Q.shape[2], Q.shape[3]
    answer = np.zeros(Q.shape[:2] + (length, V.shape[3]))
    for start in range(0, length, block_size):
        stop = min(start + block_size, length)
        rows = stop - start
        state = (np.full(Q.shape[:2] + (rows, 1), -np.inf), np.zeros(Q.shape[:2] + (rows, 1)),
                 np.zeros(Q.shape[:2] + (rows, V.shape[3])))
        key_end = stop if causal else length
        for k_start in range(0, key_end, block_size):
            k_stop = min(k_start + block_size, key_end)
            scores = np.einsum("bhqd,bhkd->bhqk", Q[:, :, start:stop], K[:, :, k_start:k_stop]) / np.sqrt(dim)
            if causal:
                future = np.arange(k_start, k_stop)[None, :] > np.arange(start, stop)[:, None]
                scores = np.where(future, -np.inf, scores)
            state = _merge_tile(state, scores, V[:, :, k_start:k_stop])
        answer[:, :, start:stop] = state[2] / state[1]
    return answer
''',
}

COMPACT = {  # one function each, einsum and stacked arithmetic, short names
    "measure_peak": '''\
def measure_peak(fn, *args, **kwargs):
    """Run ``fn(*args, **kwargs)`` once under tracemalloc; return ``(result, peak_bytes)``."""
    tracemalloc.start()
    tracemalloc.clear_traces()
    try:
        r = fn(*args, **kwargs)
        return r, int(tracemalloc.get_traced_memory()[-1])
    finally:
        tracemalloc.stop()
''',
    "head_by_head_forward": '''\
def head_by_head_forward(X, W_Q, W_K, W_V, W_O, num_heads, mask=None):
    """Multi-head attention computed one head at a time; equals the fused layer's output."""
    n = X.shape[-1] // num_heads
    y = np.zeros_like(X @ W_O)
    for j in range(0, X.shape[-1], n):
        s = np.einsum("bid,bjd->bij", X @ W_Q[:, j:j + n], X @ W_K[:, j:j + n]) * n ** -0.5
        s = s if mask is None else s + mask
        w = np.exp(s - s.max(-1)[..., None])
        del s
        y += (w / w.sum(-1)[..., None]) @ (X @ W_V[:, j:j + n]) @ W_O[j:j + n]
    return y
''',
    "chunked_attention": '''\
def chunked_attention(Q, K, V, block_size, causal=False):
    """Exact attention computed tile by tile with an online softmax; no L x L matrix is formed."""
    L, c = Q.shape[-2], Q.shape[-1] ** -0.5
    pos = np.arange(L)
    o = []
    for i in range(0, L, block_size):
        q = Q[..., i:i + block_size, :] * c
        m = np.full(q.shape[:-1], -np.inf)
        z = np.zeros(q.shape[:-1])
        a = np.zeros(q.shape[:-1] + V.shape[-1:])
        for j in range(0, min(L, i + block_size) if causal else L, block_size):
            s = np.einsum("...qd,...kd->...qk", q, K[..., j:j + block_size, :])
            if causal:
                s[..., pos[j:j + block_size][None, :] > pos[i:i + block_size][:, None]] = -np.inf
            m2 = np.fmax(m, s.max(-1))
            e = np.exp(s - m2[..., None])
            g = np.exp(m - m2)
            z = g * z + e.sum(-1)
            a = g[..., None] * a + np.einsum("...qk,...kd->...qd", e, V[..., j:j + block_size, :])
            m = m2
        o.append(a / z[..., None])
    return np.concatenate(o, axis=-2)
''',
}


def _solution() -> dict[str, str]:
    """The reference solution's answers (the instructor's, in solutions/)."""
    solution = read_notebook(REPO, "solutions", PS3)
    return {t: "\n".join(ln for ln in answer_cell(solution, t).split("\n") if "### " not in ln) for t in TASKS}


def _stubs() -> dict[str, str]:
    return {t: answer_cell(read_notebook(REPO, "assignments", PS3), t) for t in TASKS}


def _renamed(source: str) -> str:
    """Every name the answer defines changed (helpers, their arguments, variables; not the graded function and
    its arguments, which the checks call by name), and its functions in reverse order."""
    tree = ast.parse(source)
    graded = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name in TASKS]
    kept = {n.name for n in graded} | {a.arg for n in graded for a in ast.walk(n.args) if isinstance(a, ast.arg)}
    defined = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    defined |= {n.arg for n in ast.walk(tree) if isinstance(n, ast.arg)}
    defined = (defined | {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
               ) - kept
    new = {name: f"v{i}_{name[::-1].strip('_')}x" for i, name in enumerate(sorted(defined))}
    tokens, previous = [], None
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.NAME and tok.string in new and previous != ".":
            tok = tok._replace(string=new[tok.string])
        tokens.append(tok)
        previous = tok.string
    text = tokenize.untokenize(tokens)
    blocks = re.split(r"\n(?=def |import )", text)
    return "\n".join(reversed(blocks))


def _run_checks(answers: dict[str, str]) -> list[str]:
    """The hidden checks of ps3 on these answers, run here: the messages of the cells that fail."""
    release = read_notebook(REPO, "assignments", PS3)
    module = judge.load(judge.hidden_module(PS3))
    namespace: dict = {}
    cells = [c.source if _grade_id(c) not in answers else answers[_grade_id(c)] for c in release.cells
             if c.cell_type == "code" and not c.metadata.get("nbgrader", {}).get("grade")]
    with contextlib.chdir(REPO / "assignments" / PS3):  # the release reads its expected.npz from beside it
        for source in cells:
            with contextlib.redirect_stdout(io.StringIO()):
                exec(compile(source, "<answer>", "exec"), namespace)  # noqa: S102 - our own answers
    tests = [_grade_id(c) for c in release.cells if c.metadata.get("nbgrader", {}).get("grade")]
    return [m for m in (judge.judge_cell(module, t, namespace) for t in tests) if m]


def _grade_id(cell) -> str:
    return cell.metadata.get("nbgrader", {}).get("grade_id", "")


@pytest.fixture(scope="module")
def package() -> dict[str, str]:
    module = judge.load(judge.hidden_module(PS3))
    return {t: similarity.package_source(names) for t, names in module.PACKAGE_ANSWERS.items()}


# --- copies that padding and moving used to hide --------------------------------------------------------------

DEAD = "    if False:  # never runs\n" + "".join(f"        _unused_{i} = np.zeros({i + 3}) * {i} + len(str({i}))\n"
                                                for i in range(11))  # 12 lines


def _padded(source: str) -> str:
    """12 lines of dead code after the docstring of each graded function."""
    for t in TASKS:
        found = re.search(rf'def {t}\(.*?\n    """.*?"""\n', source, re.S)
        if found:
            source = source[:found.end()] + DEAD + source[found.end():]
    return source


def _moved(answers: dict[str, str]) -> tuple[str, dict[str, str]]:
    """Every answer renamed ``_my_<task>`` into one cell of the student's own, and each answer cell the release's
    signature and docstring with a one-line call: (that cell, task -> answer cell)."""
    own = "\n\n".join(re.sub(rf"\bdef {t}\(", f"def _my_{t}(", answers[t]) for t in TASKS)
    calls = {}
    for t in TASKS:
        stub = re.split(r"\n\s*(# YOUR CODE HERE|raise NotImplementedError)", _stubs()[t])[0]
        params = ast.parse(stub + "\n    pass").body[0].args
        passed = [a.arg for a in params.args] + ([f"*{params.vararg.arg}"] if params.vararg else [])
        passed += [f"**{params.kwarg.arg}"] if params.kwarg else []
        calls[t] = f"{stub}\n    return _my_{t}({', '.join(passed)})\n"
    return own, calls


# The package's chunked_attention pasted, its helper online_softmax_step inlined, fitted to the release's signature.
PASTED_CHUNKED = """\
def chunked_attention(Q, K, V, block_size, causal=False):
    \"\"\"Exact attention computed tile by tile with an online softmax; no L x L matrix is formed.\"\"\"
    B, h, Lq, d = Q.shape
    Lk = K.shape[2]
    dtype = np.result_type(Q, K, V)
    scale = 1.0 / np.sqrt(d)
    out = np.empty((B, h, Lq, V.shape[-1]), dtype=dtype)
    for qs in range(0, Lq, block_size):
        qe = min(qs + block_size, Lq)
        q = Q[..., qs:qe, :] * scale  # (B, h, bq, d)
        m_i = np.full(q.shape[:-1] + (1,), -np.inf, dtype=dtype)  # running row max
        l_i = np.zeros_like(m_i)  # running softmax denominator
        acc = np.zeros(q.shape[:-1] + (V.shape[-1],), dtype=dtype)
        k_stop = qe if causal else Lk
        for ks in range(0, k_stop, block_size):
            ke = min(ks + block_size, k_stop)
            s = q @ np.swapaxes(K[..., ks:ke, :], -1, -2)
            if causal:
                s = np.where(np.arange(ks, ke)[None, :] > np.arange(qs, qe)[:, None], -np.inf, s)
            v = V[..., ks:ke, :]
            m_new = np.maximum(m_i, s.max(axis=-1, keepdims=True))
            # rows masked so far stay at zero
            shift = np.where(np.isneginf(m_new), 0.0, m_new)
            s -= shift
            np.exp(s, out=s)  # s now holds p = exp(S - m'), in place
            # rescales what was accumulated under the old max
            alpha = np.exp(m_i - shift)
            l_new = alpha * l_i + s.sum(axis=-1, keepdims=True)
            acc *= alpha
            acc += s @ v
            m_i, l_i = m_new, l_new
        out[..., qs:qe, :] = acc / l_i
    return out
"""


def _cases() -> dict[str, dict[str, str]]:
    """student -> task -> answer cell ("own": a cell of the student's own before the first answer cell)."""
    own, calls = _moved(LOOPS)
    return {"loops": LOOPS, "compact": COMPACT, "reference": _solution(), "copy": dict(LOOPS),
            "renamed-copy": {t: _renamed(s) for t, s in LOOPS.items()},
            "padded-copy": {t: _padded(s) for t, s in LOOPS.items()}, "moved-copy": {"own": own, **calls},
            "pasted": {**COMPACT, "chunked_attention": PASTED_CHUNKED},
            "same-forced-function": {**COMPACT, "measure_peak": LOOPS["measure_peak"]}}


def _code(cells: dict[str, str]) -> str:
    return "\n\n".join(cells[c] for c in ["own", *TASKS] if c in cells)


def _given() -> list[str]:
    return [c.source for c in read_notebook(REPO, "assignments", PS3).cells if c.cell_type == "code"]


@pytest.mark.parametrize("name", ["loops", "compact", "renamed-copy", "padded-copy", "moved-copy", "pasted"])
def test_the_independent_solutions_and_the_copies_are_correct(name):
    cells = _cases()[name]
    if "own" in cells:  # the student's cell runs before the first answer cell
        cells = {**cells, TASKS[0]: cells["own"] + "\n\n" + cells[TASKS[0]]}
        del cells["own"]
    assert _run_checks(cells) == []
    assert "if False" in _cases()["padded-copy"]["chunked_attention"]


def test_similarity_flags_copies_however_padded_or_moved(package):
    """Measured here (K = 16, threshold 0.5): each copy scores 0.999 to 1.000 against loops, the package's
    chunked_attention pasted with its helper inlined 0.78 against mha_lab; correct answers written
    independently 0.09 to 0.18 against each other and 0.20 to 0.39 against the package (the reference
    solution's measure_peak: 19 shared tokens, under MIN_SHARED), a pair sharing only one forced function
    (measure_peak) 0.20. The per-task share of the union before: padded 0.67, moved 0.00, pasted 0.26."""
    code = {s: _code(cells) for s, cells in _cases().items()}
    pairs = {(p.student_a, p.student_b): p for p in similarity.compare(code, _given(), package)}
    score = {k: p.similarity for k, p in pairs.items()}
    for copy in ["copy", "renamed-copy", "padded-copy", "moved-copy"]:
        key = tuple(sorted(["loops", copy]))
        assert pairs[key].flagged and score[key] >= 0.9, (key, score[key])
    assert pairs["pasted", "mha_lab"].flagged, score["pasted", "mha_lab"]
    broken = {"x": code["pasted"] + "\n\ndef unfinished(:\n"}  # a cell that does not parse hides nothing
    assert similarity.compare(broken, _given(), package)[0].flagged
    independent = ["loops", "compact", "reference"]
    for a in independent:
        assert not pairs[a, "mha_lab"].flagged and score[a, "mha_lab"] < 0.4, (a, score[a, "mha_lab"])
        for b in independent:
            if a < b:
                assert not pairs[a, b].flagged and score[a, b] < 0.25, (a, b, score[a, b])
    # a short forced function written alike does not flag a pair on its own
    assert not pairs["loops", "same-forced-function"].flagged, score["loops", "same-forced-function"]


def test_the_similarity_view_marks_only_what_students_wrote():
    """A flagged pair's page marks the copied bodies, never the release's signature and docstring."""
    code = {s: _code(_cases()[s]) for s in ("loops", "moved-copy")}
    pair = similarity.compare(code, _given())[0]
    assert pair.flagged
    given_lines = {ln.strip() for t in TASKS for ln in _stubs()[t].splitlines()} - {""}
    for text, spans in ((pair.code_a, pair.spans_a), (pair.code_b, pair.spans_b)):
        marked = report._marked(text, spans)
        assert "<mark>" in marked and re.sub("</?mark>", "", marked) == html.escape(text)
        inside = np.zeros(len(text), bool)
        for start, end in spans:
            inside[start:end] = True
        at, given_seen = 0, 0
        for line in text.splitlines(keepends=True):
            if line.strip() in given_lines:
                given_seen += 1
                assert not inside[at:at + len(line)].any(), line
            at += len(line)
        assert given_seen >= len(TASKS)  # each signature is there, unmarked
        body = "".join(text[s:e] for s, e in spans)
        assert "_merge_tile" in body and "np.maximum" in body  # the copied code is marked


def test_a_cell_of_the_students_own_is_their_code():
    """The code read from an autograded notebook: answer cells and cells with no grade_id, not given cells."""
    nb = read_notebook(REPO, "assignments", PS3)
    nb.cells.insert(2, nbformat.v4.new_code_cell("def _mine(x):\n    return x * 2"))
    owner, code = report._tasks(nb)
    assert code.startswith("def _mine(x)") and "def measure_peak(" in code
    assert "import numpy" not in code  # the setup cell is given
    assert owner["measure_peak_values"] == "measure_peak"


# --- a small class written straight into the gradebook --------------------------------------------------

CELLS = {"t_a": 2.0, "t_b": 3.0, "t_c": 1.0}  # tests cells of one notebook, after the answer cell ans_f
SCORES = {"ann": (2, 3, 1), "bob": (0, 3, 0), "cy": (2, 0, 1), "dee": (0, 0, 0), "eve": (2, 3, 0)}
DUE = datetime(2026, 11, 20, 17, 0, 0)


def _notebook(student: str, scores: tuple[float, ...]) -> nbformat.NotebookNode:
    """An autograded notebook: the answer cell, then the tests cells, failed ones with a hidden-check message."""
    nb = nbformat.v4.new_notebook()
    answer = nbformat.v4.new_code_cell(f"def f(x):\n    return x + {len(student)}")
    answer.metadata["nbgrader"] = {"grade_id": "ans_f", "solution": True, "grade": False}
    nb.cells.append(answer)
    for (cell, points), got in zip(CELLS.items(), scores, strict=True):
        code = nbformat.v4.new_code_cell(f"# {cell}")
        code.metadata["nbgrader"] = {"grade_id": cell, "grade": True, "solution": False, "points": points}
        if got < points:
            bug = "off-by-one" if cell != "t_c" else "wrong-sign"
            msg = f"{cell}: 1 hidden check(s) failed\n- test_{cell}: f(1) is wrong. Likely bug: says {bug} [bug: {bug}]"
            code.outputs = [nbformat.v4.new_output("error", ename="HiddenCheckFailure", evalue=msg, traceback=[msg])]
        nb.cells.append(code)
    return nb


@pytest.fixture(scope="module")
def small_class(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("class")
    shutil.copy(REPO / "nbgrader_config.py", root)
    with course.gradebook(root) as gb:
        gb.update_or_create_assignment("hw", duedate=DUE)
        gb.add_notebook("hw", "hw")
        for cell, points in CELLS.items():
            gb.add_grade_cell(cell, "hw", "hw", max_score=points, cell_type="code")
        gb.add_solution_cell("ans_f", "hw", "hw")
        gb.add_source_cell("ans_f", "hw", "hw", cell_type="code", source="def f(x):\n    raise NotImplementedError")
        for i, (s, scores) in enumerate({**SCORES, "gus": (0, 0, 0)}.items()):
            gb.update_or_create_student(s)
            gb.add_submission("hw", s, timestamp=DUE + timedelta(hours=5 * i - 2))
            for cell, got in zip(CELLS, scores, strict=True):
                gb.find_grade(cell, "hw", "hw", s).auto_score = got
            if s == "bob":  # 3 h late: the report's scores are final ones
                gb.find_submission_notebook("hw", "hw", s).late_submission_penalty = 1.0
            if s != "gus":  # recorded, but no notebook was run: not graded
                folder = root / "autograded" / s / "hw"
                folder.mkdir(parents=True)
                nbformat.write(_notebook(s, scores), folder / "hw.ipynb")
        gb.db.commit()
    (root / "submitted" / "hal" / "hw").mkdir(parents=True)  # handed in, never graded
    (root / "tests" / "hidden").mkdir(parents=True)
    (root / "tests" / "hidden" / "test_hw.py").write_text('PACKAGE_ANSWERS = {"f": ["mha_lab.cpu.softmax"]}\n')
    return root


def test_pass_rates_and_discrimination_match_an_independent_calculation(small_class):
    data = report.read_class(small_class, "hw")
    stats = {r["cell"]: r for r in report.cell_statistics(data)}
    grid = np.array(list(SCORES.values()), dtype=float)  # students x cells
    for j, (cell, points) in enumerate(CELLS.items()):
        x, y = grid[:, j], grid.sum(axis=1) - grid[:, j]
        r = ((x - x.mean()) * (y - y.mean())).sum() / np.sqrt(((x - x.mean()) ** 2).sum() * ((y - y.mean()) ** 2).sum())
        assert stats[cell]["pass_rate"] == pytest.approx(np.mean(x == points))
        assert stats[cell]["discrimination"] == pytest.approx(r)
        assert stats[cell]["task"] == "f" and stats[cell]["points"] == points


def test_counts_late_and_misconceptions(small_class):
    data = report.read_class(small_class, "hw")
    assert data.submitted == ["ann", "bob", "cy", "dee", "eve", "gus", "hal"]
    assert sorted(data.scores) == sorted(SCORES)  # gus and hal are not graded
    # timestamps DUE - 2 h, + 3 h, + 8 h, ...: all but ann are late
    assert data.late == pytest.approx({s: 5 * i - 2 for i, s in enumerate(SCORES) if i > 0})
    groups = [(g["task"], tuple(g["bugs"]), tuple(g["students"])) for g in report.misconceptions(data)]
    assert groups == [("f", ("off-by-one", "wrong-sign"), ("bob", "dee")),  # largest first
                      ("f", ("off-by-one",), ("cy",)), ("f", ("wrong-sign",), ("eve",))]
    assert data.penalty["bob"] == 1 and data.finals["bob"] == data.totals["bob"] - 1
    assert data.finals["cy"] == data.totals["cy"]


def test_a_line_that_cannot_tell_two_bugs_apart_is_one_of_them():
    """One line naming two bugs groups as "one of: ..."; another line naming one of them alone settles it."""
    line = "- test_t: wrong. Likely bug: np.tile? [bug: tile-not-repeat]. Or: transpose? [bug: reshape-no-transpose]"
    data = report.ClassData("a", [report.TestsCell("a", "t", 1, "f"), report.TestsCell("a", "u", 1, "f")], [],
                            messages={"amy": {"t": f"t: 1 failed\n{line}"},
                                      "ben": {"t": f"t: 1 failed\n{line}",
                                              "u": "u: 1 failed\n- test_u: wrong [bug: reshape-no-transpose]"}})
    groups = {g["students"][0]: g["bugs"] for g in report.misconceptions(data)}
    assert groups == {"amy": ["one of: reshape-no-transpose, tile-not-repeat"], "ben": ["reshape-no-transpose"]}


def test_report_files_and_cli(small_class, capsys):
    from mha_lab.__main__ import main

    assert main(["report", "hw", "--course", str(small_class)]) == 0
    out = small_class / "reports" / "hw"
    assert str(out / "index.html") in capsys.readouterr().out
    with open(out / "similarity.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == ["student_a", "student_b", "similarity", "flagged"]
    assert len(rows) == 10 + 5  # every pair of the five graded students, and each against mha_lab
    assert [float(r["similarity"]) for r in rows] == sorted((float(r["similarity"]) for r in rows), reverse=True)
    md = (out / "report.md").read_text()
    assert "| 2 | f | off-by-one + wrong-sign | says off-by-one; says wrong-sign | bob, dee |" in md
    assert "submitted: 7, graded: 5, not graded: 2, late: 4" in md and "](scores.svg)" in md
    assert (out / "scores.svg").read_text().startswith("<svg")
    page = (out / "index.html").read_text()
    assert "<svg" in page and "Figure 1." in page and not re.search(r"""(src|href)=["']?(http|//)""", page)
    with pytest.raises(SystemExit):
        main(["report", "nope", "--course", str(small_class)])
    assert "'nope' is not in the gradebook" in capsys.readouterr().err


def test_every_hint_of_the_hidden_checks_carries_a_bug_id():
    """A hint written as a literal (``hint="..."``, ``*_HINT = "..."``) must end with ``[bug: <id>]``."""
    untagged = []
    for path in sorted((REPO / "tests" / "hidden").glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            values = []
            if isinstance(node, ast.keyword) and node.arg in ("hint", "nonfinite_hint"):
                values = [node.value]
            elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id.endswith("HINT")
                                                      for t in node.targets):
                values = [node.value]
            for v in values:
                if isinstance(v, ast.Constant) and not checks.bug_ids(v.value):
                    untagged.append(f"{path.name}:{v.lineno}")
    assert not untagged, f"hints without a [bug: <id>]: {untagged}"


@needs_chromium
def test_the_report_page_renders_offline_in_chromium(small_class):
    from playwright.sync_api import sync_playwright

    page_path = report.build(small_class, "hw") / "index.html"
    errors, requests = [], []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))

            def only_files(route):  # the page is self-contained: anything off the disk is refused and noted
                requests.append(route.request.url)
                route.continue_() if route.request.url.startswith("file://") else route.abort()

            page.route("**/*", only_files)
            page.goto(page_path.as_uri(), wait_until="load")
            figure = page.locator("#histogram svg").bounding_box()
            bars = page.locator("#histogram svg path").count()
            heading = page.locator("h1").inner_text()
        finally:
            browser.close()
    assert not errors, errors
    assert requests == [page_path.as_uri()], f"the page loads more than itself: {requests}"
    assert figure and figure["width"] > 300 and figure["height"] > 150, figure
    assert bars > 5 and heading == "Class report: hw"


def test_markdown_rows_hold_students_text_as_text():
    """report.md puts ids and check messages in table cells: a student id with markup, a pipe, an entity or a line
    break shows as typed, in its own cell, when the Markdown is rendered (index.html escapes it for HTML instead),
    and the file itself holds no HTML entities."""
    from markdown_it import MarkdownIt

    said = ["<img src=x onerror=alert(1)>", "a|b", "two\nlines `merge_partials` x'[i] *em* [l](u)", "&#96; &amp; \\ 3"]
    row = report._md_row(said)
    assert "\n" not in row and not re.search(r"&#?\w+;", row.replace("\\&", "")), row
    markdown = MarkdownIt("commonmark").enable("table").enable("strikethrough")
    page = markdown.render(f"| a | b | c | d |\n|---|---|---|---|\n{row}\n")
    cells = re.findall(r"<td>(.*?)</td>", page, re.S)
    assert [html.unescape(c) for c in cells] == [" ".join(t.split()) for t in said], page
    assert not re.search(r"<(?!/?(table|thead|tbody|tr|th|td)\b)", page), page


def test_a_blank_answer_is_counted_apart_not_as_a_misconception():
    def blank(cell):
        return f"{cell}: 1 failed\n- test_{cell}: `f` is not implemented yet [bug: not-implemented]"

    data = report.ClassData("a", [report.TestsCell("a", "t", 1, "f"), report.TestsCell("a", "u", 1, "g")], [],
                            messages={"amy": {"t": blank("t"), "u": "u: 1 failed\n- test_u: wrong [bug: off-by-one]"},
                                      "ben": {"t": blank("t"), "u": blank("u")},
                                      "cal": {"t": "t: 1 failed\n- test_t: wrong [bug: off-by-one]"}})
    groups = [(g["task"], g["bugs"], g["students"]) for g in report.misconceptions(data)]
    assert groups == [("f", ["off-by-one"], ["cal"]), ("g", ["off-by-one"], ["amy"])]
    assert report.blank_answers(data) == [{"task": "f", "students": ["amy", "ben"]}, {"task": "g", "students": ["ben"]}]
