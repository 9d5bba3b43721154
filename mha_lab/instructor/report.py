"""The class report of one graded assignment: ``reports/<a>/index.html``, ``report.md`` (with ``scores.svg``)
and ``similarity.csv``.

``python -m mha_lab report <a> --course DIR`` (``make report A=<a>``; ``make grade`` writes it too) reads the
gradebook (nbgrader's API) and the autograded notebooks, and grades nothing again:

- the scores' histogram; submitted / graded / not graded / late counts (late: the submission's timestamp
  after its due date, as the gradebook has them);
- per tests cell: points, pass rate (share of graded students with full points) and discrimination, the
  correlation of the cell's score with the rest of the total (PrairieLearn's question statistics):
  r = corr(s_c, T - s_c) over graded students, none when either side is constant;
- misconceptions: per task (answer cell), students grouped by the bug ids their failing checks name
  (``mha_lab.grading.checks.BUG_TAG``), largest group first; a blank answer (every failing check of the task says
  ``not-implemented``) is no misconception: blank answers are counted apart, per task;
- similarity of the code each student wrote (``mha_lab.instructor.similarity``), flagged pairs side by side,
  only student-written code highlighted.
"""

from __future__ import annotations

import argparse
import html
import io
import re
import sys
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import nbformat
import numpy as np

from mha_lab.grading import checks, course, judge
from mha_lab.grading.batch import MEMORY_READING
from mha_lab.instructor import similarity, spreadsheet

__all__ = ["TestsCell", "ClassData", "read_class", "cell_statistics", "misconceptions", "blank_answers", "build",
           "write_similarity_csv", "main"]


@dataclass(frozen=True)
class TestsCell:
    """A graded tests cell: its notebook, id and points, and its task (the answer cell it follows)."""

    notebook: str
    grade_id: str
    points: float
    task: str = ""


@dataclass
class ClassData:
    """What the report reads: cells, scores (student -> grade_id -> points), failure messages, students' code."""

    assignment: str
    cells: list[TestsCell]
    submitted: list[str]
    scores: dict[str, dict[str, float]] = field(default_factory=dict)  # graded students only
    late: dict[str, float] = field(default_factory=dict)  # student -> hours late (late ones only)
    penalty: dict[str, float] = field(default_factory=dict)  # student -> points the late penalty took
    messages: dict[str, dict[str, str]] = field(default_factory=dict)  # student -> grade_id -> hidden-check message
    code: dict[str, str] = field(default_factory=dict)  # student -> every answer cell and cell of their own, joined
    given: list[str] = field(default_factory=list)  # the release's code: given cells, tests, answer stubs

    @property
    def totals(self) -> dict[str, float]:
        return {s: sum(row.values()) for s, row in self.scores.items()}

    @property
    def finals(self) -> dict[str, float]:
        """student -> final score: the total after the late penalty, as the gradebook and the exports have it."""
        return {s: total - self.penalty.get(s, 0.0) for s, total in self.totals.items()}

    @property
    def max_score(self) -> float:
        return sum(c.points for c in self.cells)


def _meta(cell: nbformat.NotebookNode) -> dict:
    return cell.get("metadata", {}).get("nbgrader", {})


def _tasks(nb: nbformat.NotebookNode) -> tuple[dict[str, str], str]:
    """(tests cell grade_id -> its task, the code the student wrote): a tests cell belongs to the answer cell
    before it, the task is that cell's grade_id without ``ans_``; the student's code is every answer cell and
    every code cell that is not the release's (no grade_id), in order."""
    owner, code, task = {}, [], ""
    for cell in nb.cells:
        meta = _meta(cell)
        if cell.cell_type != "code":
            continue
        if meta.get("solution") and not meta.get("grade"):
            task = meta["grade_id"].removeprefix("ans_")
            code.append(cell.source)
        elif meta.get("grade"):
            owner[meta["grade_id"]] = task
        elif not meta.get("grade_id"):
            code.append(cell.source)
    return owner, "\n\n".join(code)


def _failure(nb: nbformat.NotebookNode) -> dict[str, str]:
    """grade_id -> the hidden-check message the grader put into its tests cell."""
    return {_meta(c)["grade_id"]: o.get("evalue", "") for c in nb.cells if _meta(c).get("grade")
            for o in c.get("outputs", []) if o.get("ename") == "HiddenCheckFailure"}


def _ungraded_code(root: Path, assignment: str) -> list[str]:
    """The source notebooks' code cells that nbgrader releases as they are, with no grade_id (the gradebook keeps
    only graded and locked cells): given code, although a student's notebook carries it as a cell of its own."""
    return [c.source for path in sorted((root / "solutions" / assignment).glob("*.ipynb"))
            for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code" and not _meta(c).get("grade_id")]


def read_class(root: Path, assignment: str) -> ClassData:
    """The assignment's cells and scores from ``gradebook.db``, messages and code from ``autograded/``."""
    from nbgrader.api import MissingEntry

    root = Path(root)
    if not (root / "gradebook.db").is_file():
        raise FileNotFoundError(f"no gradebook in {root}: grade first (make grade A={assignment})")
    with course.gradebook(root) as gb:
        try:
            record = gb.find_assignment(assignment)
        except MissingEntry:
            raise ValueError(f"assignment {assignment!r} is not in the gradebook: grade it first") from None
        cells = [TestsCell(nb.name, g.name, float(g.max_score)) for nb in record.notebooks for g in nb.grade_cells
                 if g.cell_type == "code"]
        given = [c.source for nb in record.notebooks for c in nb.source_cells if c.cell_type == "code"]
        data = ClassData(assignment, cells, sorted(set(course.students(root, assignment))
                                                   | {s.student.id for s in record.submissions}),
                         given=given + _ungraded_code(root, assignment))
        for sub in record.submissions:
            s = sub.student.id
            folder = root / "autograded" / s / assignment
            if not all((folder / f"{nb.name}.ipynb").is_file() for nb in record.notebooks):
                continue  # recorded without a notebook to run: not graded
            data.scores[s] = {g.name: float(g.score) for nb in sub.notebooks for g in nb.grades
                              if g.cell_type == "code"}
            if sub.timestamp and sub.duedate and sub.total_seconds_late > 0:
                data.late[s] = sub.total_seconds_late / 3600
            data.penalty[s] = float(sub.late_submission_penalty or 0.0)
    owner: dict[str, str] = {}  # tests cell -> task, from the cells' order in the notebooks
    for s in data.scores:
        try:
            for path in sorted((root / "autograded" / s / assignment).glob("*.ipynb")):
                nb = nbformat.read(path, as_version=4)
                tasks, code = _tasks(nb)
                owner.update(tasks)
                data.messages.setdefault(s, {}).update(_failure(nb))
                data.code[s] = "\n\n".join(filter(None, [data.code.get(s, ""), code]))
        except Exception:  # noqa: BLE001 - a notebook that cannot be read costs its own student's entries only
            data.messages.pop(s, None)
            data.code.pop(s, None)
    data.cells = [TestsCell(c.notebook, c.grade_id, c.points, owner.get(c.grade_id, "")) for c in data.cells]
    return data


def cell_statistics(data: ClassData) -> list[dict]:
    """Per tests cell: points, pass rate and discrimination over the graded students."""
    students = sorted(data.scores)
    totals = np.array([data.totals[s] for s in students])
    rows = []
    for c in data.cells:
        got = np.array([data.scores[s].get(c.grade_id, 0.0) for s in students])
        rest = totals - got
        r = float(np.corrcoef(got, rest)[0, 1]) if len(got) > 1 and got.std() > 0 and rest.std() > 0 else None
        rows.append({"cell": c.grade_id, "task": c.task, "points": c.points,
                     "pass_rate": float(np.mean(got >= c.points)) if len(got) else None, "discrimination": r})
    return rows


def _phrase(line: str) -> str:
    """What a failure line says, without the check's name and the tag: the likely bug when it names one."""
    text = checks.BUG_TAG.sub("", line.split(": ", 1)[-1]).strip()
    return text.rsplit("Likely bug: ", 1)[-1].strip().rstrip(".")


def _label(ids: list[str]) -> str:
    """A failure line's bug: its one id, or "one of: a, b" when it names several it cannot tell apart."""
    return ids[0] if len(set(ids)) == 1 else "one of: " + ", ".join(sorted(set(ids)))


BLANK = ("not-implemented",)  # the bugs of a task left as released: a blank answer, not a misconception


def _named(data: ClassData) -> tuple[dict[tuple[str, tuple[str, ...]], set[str]], dict[tuple[str, str], str]]:
    """(task, the bugs its failing checks name) -> students; and ``says`` (task, bug) -> what a line said."""
    task_of = {c.grade_id: c.task for c in data.cells}
    groups: dict[tuple[str, tuple[str, ...]], set[str]] = defaultdict(set)
    says: dict[tuple[str, str], str] = {}
    for s, messages in data.messages.items():
        lines: dict[str, list[tuple[str, list[str]]]] = defaultdict(list)
        for grade_id, message in messages.items():
            lines[task_of.get(grade_id, "")] += [(line, checks.bug_ids(line) or ["unlabelled"])
                                                 for line in message.splitlines()[1:]]
        for task, found in lines.items():
            alone = {ids[0] for _, ids in found if len(set(ids)) == 1}
            named = {_label(ids) for _, ids in found if len(set(ids)) == 1 or not alone & set(ids)}
            for line, ids in found:
                says.setdefault((task, _label(ids)), _phrase(line))
            groups[task, tuple(sorted(named))].add(s)
    return groups, says


def misconceptions(data: ClassData) -> list[dict]:
    """Groups of students whose failing checks of one task name the same bugs, largest first:
    ``{"task", "bugs", "says", "students"}`` (``says``: bug -> what the first message said of it). A line that
    names several bugs it cannot tell apart counts as "one of: ...", unless another line of the task names one
    of them alone. Blank answers are not among them (``blank_answers``)."""
    groups, says = _named(data)
    ordered = sorted(((k, v) for k, v in groups.items() if k[1] != BLANK), key=lambda kv: (-len(kv[1]), kv[0]))
    return [{"task": t, "bugs": list(ids), "says": {b: says[t, b] for b in ids}, "students": sorted(who)}
            for (t, ids), who in ordered]


def blank_answers(data: ClassData) -> list[dict]:
    """Per task, in the notebook's order, the graded students who left it as released: ``{"task", "students"}``."""
    groups, _ = _named(data)
    tasks = list(dict.fromkeys(c.task for c in data.cells))
    return [{"task": t, "students": sorted(groups[t, BLANK])} for t in tasks if groups.get((t, BLANK))]


def _package_answers(assignment: str, root: Path) -> dict[str, str]:
    """task -> the package's own source for it (``PACKAGE_ANSWERS`` of the hidden module)."""
    module = judge.load(judge.hidden_module(assignment, root))
    return {t: similarity.package_source(names) for t, names in getattr(module, "PACKAGE_ANSWERS", {}).items()}


def _histogram_svg(data: ClassData) -> str:
    """The totals' histogram as inline SVG (no external references)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.2))
    top = data.max_score or 1.0
    ax.hist(list(data.finals.values()), bins=np.linspace(0, top, min(max(int(top), 1), 20) + 1), color="#3b6ea5",
            edgecolor="white")
    ax.set_xlabel(f"final score (points out of {top:g}, after late penalties)", fontsize=11)
    ax.set_ylabel("students", fontsize=11)
    ax.set_xlim(0, top)
    ax.yaxis.get_major_locator().set_params(integer=True)
    ax.tick_params(labelsize=10)
    fig.tight_layout()
    out = io.StringIO()
    fig.savefig(out, format="svg")
    plt.close(fig)
    svg = out.getvalue()
    return svg[svg.index("<svg"):]


def _fmt(x: float | None, digits: int = 2) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"


def build(root: Path, assignment: str) -> Path:
    """Write ``reports/<a>/index.html``, ``report.md``, ``scores.svg`` and ``similarity.csv``; returns the folder."""
    root = Path(root).resolve()
    data = read_class(root, assignment)
    stats, groups, blanks = cell_statistics(data), misconceptions(data), blank_answers(data)
    pairs = similarity.compare(data.code, data.given, _package_answers(assignment, root), shown=SIDE_BY_SIDE)
    out = root / "reports" / assignment
    out.mkdir(parents=True, exist_ok=True)
    write_similarity_csv(pairs, out / "similarity.csv")
    counts = {"submitted": len(data.submitted), "graded": len(data.scores),
              "not graded": len(data.submitted) - len(data.scores), "late": len(data.late),
              "memory": _memory_modes(root / f"grades_{assignment}.csv")}
    flagged = [p for p in pairs if p.flagged]
    svg = _histogram_svg(data)
    (out / "scores.svg").write_text(svg, encoding="utf-8")  # the figure of report.md; index.html has it inline
    memory = memory_rows(root / f"grades_{assignment}.csv")
    (out / "report.md").write_text(_markdown(data, counts, stats, groups, blanks, flagged, memory), encoding="utf-8")
    (out / "index.html").write_text(_html(data, counts, stats, groups, blanks, flagged, svg, memory), encoding="utf-8")
    return out


def write_similarity_csv(pairs: Sequence[similarity.Pair], path: Path) -> None:
    """``similarity.csv``: every pair, most similar first (student ids neutralised for spreadsheets)."""
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = spreadsheet.writer(f)
        writer.writerow(["student_a", "student_b", "similarity", "flagged"])
        writer.writerows((p.student_a, p.student_b, f"{p.similarity:.3f}", str(p.flagged).lower()) for p in pairs)


def _memory_modes(grades: Path) -> str:
    """How the graded students' memory was measured, from the grade sheet's ``memory`` column."""
    if not grades.is_file():
        return "unknown"
    with open(grades, newline="", encoding="utf-8") as f:
        modes = sorted({row.get("memory") or "" for row in spreadsheet.DictReader(f)} - {""})
    return "; ".join(modes) or "unknown"


def memory_rows(grades: Path) -> list[tuple[str, ...]]:
    """Per tests cell that measures memory, the grader's readings over the graded students (``grades_<a>.csv``'s
    ``memory_peak``): students measured, smallest, median and largest peak, the budget, how many were over it."""
    if not grades.is_file():
        return []
    found: dict[str, list[tuple[float, float]]] = defaultdict(list)
    with open(grades, newline="", encoding="utf-8") as f:
        for row in spreadsheet.DictReader(f):
            for part in filter(None, (row.get("memory_peak") or "").split("; ")):
                cell, _, reading = part.partition(": ")
                if m := MEMORY_READING.fullmatch(reading):
                    found[cell].append((float(m["peak"]), float(m["budget"])))
    rows = []
    for cell, readings in sorted(found.items()):
        peaks = np.array([p for p, _ in readings])
        budgets = sorted({b for _, b in readings})
        rows.append((cell, str(len(peaks)), f"{peaks.min():.2f}", f"{np.median(peaks):.2f}", f"{peaks.max():.2f}",
                     " / ".join(f"{b:.2f}" for b in budgets), str(sum(p > b for p, b in readings))))
    return rows


MEMORY_HEAD = ["cell", "students measured", "smallest peak (MiB)", "median peak (MiB)", "largest peak (MiB)",
               "budget (MiB)", "over budget"]


def _table_rows(stats: Sequence[dict]) -> list[tuple[str, ...]]:
    return [(r["cell"], r["task"], f"{r['points']:g}", _fmt(r["pass_rate"]), _fmt(r["discrimination"]))
            for r in stats]


def _late_rows(data: ClassData) -> list[tuple[str, ...]]:
    """Per late student: hours late, raw score, penalty, final score."""
    return [(s, f"{h:.1f}", f"{data.totals.get(s, 0.0):g}", f"-{data.penalty.get(s, 0.0):g}",
             f"{data.finals.get(s, 0.0):g}") for s, h in sorted(data.late.items())]


def _group_rows(groups: Sequence[Mapping]) -> list[list[str]]:
    """Per misconception: how many students, the task, its bugs, what the checks say of them, who."""
    return [[str(len(g["students"])), g["task"], " + ".join(g["bugs"]), "; ".join(g["says"].values()),
             ", ".join(g["students"])] for g in groups]


MARKDOWN_SPECIAL = re.compile(r"([\\`*_\[\]<>|&!~#$])")  # what could start markup, an entity or a cell break


def _md_row(cells: Sequence[str]) -> str:
    """One row of a markdown table whose cells hold students' text (ids, messages) as text: every character that
    Markdown could read as markup (code, emphasis, links, HTML, entities, a cell break) escaped with a backslash,
    which shows as the character itself; no line break."""
    text = (MARKDOWN_SPECIAL.sub(r"\\\1", " ".join(str(c).split())) for c in cells)
    return "| " + " | ".join(text) + " |"


def _blank_rows(blanks: Sequence[dict]) -> list[list[str]]:
    return [[b["task"], str(len(b["students"])), ", ".join(b["students"])] for b in blanks]


MEMORY_NOTE = ("The grader's peak readings, from outside each student's process (MiB = 2**20 bytes), over the "
               "graded students whose result was right; every reading is in grades_<assignment>.csv (memory_peak).")
BLANK_NOTE = "Tasks left as released (every check says not implemented): counted here, not as misconceptions."


def _markdown(data: ClassData, counts: dict, stats: list, groups: list, blanks: list, flagged: list,
              memory: list) -> str:
    finals, totals = list(data.finals.values()), list(data.totals.values())
    lines = [f"# Class report: {data.assignment}", "",
             ", ".join(f"{k}: {v}" for k, v in counts.items()) + (f"; mean final score {np.mean(finals):.2f} of "
                                                                    f"{data.max_score:g} (raw {np.mean(totals):.2f})"
                                                                    if totals else ""), "",
             f"![Figure 1. Final scores of the {len(data.scores)} graded students (points out of "
             f"{data.max_score:g}, after late penalties).]"
             "(scores.svg)", "", "## Tests cells", "", "| cell | task | points | pass rate | discrimination |",
             "|---|---|---|---|---|"]
    lines += [_md_row(row) for row in _table_rows(stats)]
    if memory:
        lines += ["", "## Measured memory", "", MEMORY_NOTE, "", _md_row(MEMORY_HEAD),
                  "|" + "---|" * len(MEMORY_HEAD)]
        lines += [_md_row(row) for row in memory]
    lines += ["", "## Misconceptions", "", "| students | task | bug | what the checks say | who |",
              "|---|---|---|---|---|"]
    lines += [_md_row(row) for row in _group_rows(groups)]
    lines += ["", "## Blank answers", "", BLANK_NOTE, "", "| task | students | who |", "|---|---|---|"]
    lines += [_md_row(row) for row in _blank_rows(blanks)] or ["| none | | |"]
    lines += ["", f"## Similarity (flagged at {similarity.THRESHOLD:g} or above; all pairs in similarity.csv)", "",
              "| student a | student b | similarity |", "|---|---|---|"]
    lines += [_md_row([p.student_a, p.student_b, f"{p.similarity:.2f}"]) for p in flagged] or ["| none | | |"]
    if data.late:
        lines += ["", "## Late", "", "| student | hours late | raw score | penalty | final score |",
                  "|---|---|---|---|---|"]
        lines += [_md_row(row) for row in _late_rows(data)]
    return "\n".join(lines) + "\n"


SIDE_BY_SIDE = 40  # flagged pairs shown side by side (the most similar first); all of them are in the table
CSS = """body{font:15px/1.45 system-ui,sans-serif;max-width:72rem;margin:2rem auto;padding:0 1rem;color:#222}
table{border-collapse:collapse;margin:.5rem 0 1.5rem}td,th{border:1px solid #ccc;padding:.25rem .5rem;
text-align:left;vertical-align:top}th{background:#f3f3f3}figure{margin:1rem 0}figcaption{font-size:.9rem}
mark{background:#fde68a}.pair{display:grid;grid-template-columns:1fr 1fr;gap:.75rem}pre{background:#f7f7f7;
padding:.5rem;white-space:pre-wrap;font-size:12px;margin:0}"""


def _html_table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    cells = "".join("<tr>" + "".join(f"<td>{html.escape(str(x))}</td>" for x in row) + "</tr>" for row in rows)
    return "<table><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in head) + f"</tr>{cells}</table>"


def _html(data: ClassData, counts: dict, stats: list, groups: list, blanks: list, flagged: list, svg: str,
          memory: list) -> str:
    e = html.escape
    parts = [f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>Class report: {e(data.assignment)}"
             f"</title><style>{CSS}</style></head><body><h1>Class report: {e(data.assignment)}</h1>",
             _html_table(list(counts), [[str(v) for v in counts.values()]]),
             f"<figure id='histogram'>{svg}<figcaption>Figure 1. Final scores of the {len(data.scores)} graded "
             f"students (points out of {data.max_score:g}, after late penalties).</figcaption></figure>",
             "<h2>Tests cells</h2>",
             _html_table(["cell", "task", "points", "pass rate", "discrimination"], _table_rows(stats)),
             *([f"<h2>Measured memory</h2><p>{MEMORY_NOTE}</p>", _html_table(MEMORY_HEAD, memory)] if memory else []),
             "<h2>Misconceptions</h2>",
             _html_table(["students", "task", "bug", "what the checks say", "who"], _group_rows(groups)),
             f"<h2>Blank answers</h2><p>{BLANK_NOTE}</p>",
             _html_table(["task", "students", "who"], _blank_rows(blanks) or [["none", "", ""]]),
             f"<h2>Similarity</h2><p>Pairs at similarity {similarity.THRESHOLD:g} or above: the larger share of one "
             "side's own code (every answer and cell of its own, the release's code left out) that the other side has "
             "too; every pair is in similarity.csv. Highlighted: code of the student's found on the other side.</p>",
             _html_table(["student a", "student b", "similarity"],
                         [[p.student_a, p.student_b, f"{p.similarity:.2f}"] for p in flagged] or [["none", "", ""]])]
    shown = [p for p in flagged if p.student_b == similarity.PACKAGE]
    shown += [p for p in flagged if p.student_b != similarity.PACKAGE][:SIDE_BY_SIDE]
    if len(shown) < len(flagged):
        parts.append(f"<p>Side by side below: the pairs with mha_lab and the {SIDE_BY_SIDE} most similar pairs of "
                     f"students, of {len(flagged)} flagged pairs.</p>")
    for p in shown:
        parts.append(f"<h3>{e(p.student_a)} and {e(p.student_b)}: {p.similarity:.2f}</h3><div class='pair'>"
                     f"<pre>{_marked(p.code_a, p.spans_a)}</pre><pre>{_marked(p.code_b, p.spans_b)}</pre></div>")
    if data.late:
        parts += ["<h2>Late</h2>", _html_table(["student", "hours late", "raw score", "penalty", "final score"],
                                               _late_rows(data))]
    return "".join(parts) + "</body></html>\n"


def _marked(code: str, spans: Sequence[tuple[int, int]]) -> str:
    """``code`` escaped for HTML, its ``spans`` (found in the other answer) in <mark>."""
    out, at = [], 0
    for start, end in sorted(spans):
        start = max(start, at)
        out += [html.escape(code[at:start]), f"<mark>{html.escape(code[start:end])}</mark>"] if end > start else []
        at = max(at, end)
    return "".join(out) + html.escape(code[at:])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mha_lab report", description="Write the class report of a "
                                     "graded assignment from the gradebook and the autograded notebooks.")
    parser.add_argument("assignment", help="e.g. ps1_per_head_loop")
    parser.add_argument("--course", type=Path, default=Path.cwd(), help="course root (default: here)")
    args = parser.parse_args(argv)
    if not re.fullmatch(r"[\w-]+", args.assignment):
        parser.error(f"not an assignment name: {args.assignment!r}")
    try:
        out = build(args.course, args.assignment)
    except (FileNotFoundError, ValueError) as exc:
        parser.exit(1, f"cannot write the report: {exc}\n")
    print(f"wrote {out / 'index.html'}, {out / 'report.md'}, {out / 'similarity.csv'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
