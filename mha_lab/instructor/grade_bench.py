"""``python -m mha_lab grade-bench [--n 200] [--jobs 2]``: grade a generated class and time it.

Generates ``n`` ps1 submissions in a temporary course (honest, buggy, blank and a few hostile, each
knowing the score it deserves), grades them with the real grading command, and prints the wall time,
the per-submission p50/p95 (run + judge, from the CSV's phase timings) and whether every submission
came back exactly once with exactly its score. Targets for n = 200 with ``--jobs 2`` on two cores:
under 10 minutes wall and p95 under 8 s. Exit status 1 when a row is lost, duplicated or wrong.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np

from mha_lab.instructor import classroom

ASSIGNMENT = "ps1_per_head_loop"
# One class in twenty submissions: 12 honest, 4 buggy, 3 blank, 1 hostile.
CYCLE = ("honest", "buggy", "honest", "blank", "hostile", "honest", "honest", "buggy", "honest", "honest",
         "blank", "honest", "honest", "buggy", "honest", "honest", "blank", "honest", "buggy", "honest")
HOSTILE = ("exit_kernel", "input_transformer", "numpy_patch", "fork_storm", "kill_ancestors", "infinite_loop")
PHASES = ("run_s", "judge_s")  # the CSV's per-submission phase timings that count as its own time
WALL_TARGET, P95_TARGET = 600.0, 8.0


def generate(course: Path, n: int) -> dict[str, classroom.Student]:
    """``n`` submissions of ps1 in the course, mixed as in ``CYCLE``; student name -> what it deserves."""
    by_name = {a.name: a for a in classroom.attacks() if a.assignment == ASSIGNMENT}
    attacks = [by_name[name] for name in HOSTILE]
    students, seen = {}, Counter()
    for i in range(n):
        kind = CYCLE[i % len(CYCLE)]
        name = f"{kind}-{i:03d}"
        if kind == "honest":
            students[name] = classroom.honest(course, name, ASSIGNMENT)
        elif kind == "buggy":
            students[name] = classroom.buggy(course, name, ASSIGNMENT, seen[kind])
        elif kind == "blank":
            students[name] = classroom.blank(course, name, ASSIGNMENT)
        else:
            attack = attacks[seen[kind] % len(attacks)]
            target = classroom.Target(f"grade-bench-{i}-{attack.name}", 9, str(course), str(classroom.REPO),
                                      os.getpid())
            students[name] = classroom.hostile(course, name, attack, target)
        seen[kind] += 1
    return students


def check(students: dict[str, classroom.Student], rows: list[dict[str, str]]) -> list[str]:
    """Every problem with the returned rows: a student missing, duplicated, unknown or with the wrong score."""
    problems = []
    count = Counter(r["student"] for r in rows)
    problems += [f"{s}: no row" for s in students if count[s] == 0]
    problems += [f"{s}: {c} rows" for s, c in count.items() if c > 1]
    problems += [f"{s}: a row for no submission" for s in count if s not in students]
    for r in rows:
        s = students.get(r["student"])
        if s is None:
            continue
        score = float(r["score"])
        if score > s.expected or (not s.at_most and score != s.expected):
            problems.append(f"{s.name} ({s.kind}): score {score:g}, expected {s.expected:g}")
    return problems


def per_submission_seconds(rows: list[dict[str, str]]) -> np.ndarray:
    """Each submission's own time (the sum of ``PHASES``); empty when the CSV has no such columns."""
    if not rows or any(p not in rows[0] for p in PHASES):
        return np.array([])
    return np.array([sum(float(r[p] or 0) for p in PHASES) for r in rows])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mha_lab grade-bench", description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=200, help="submissions to generate (default 200)")
    parser.add_argument("--jobs", type=int, default=2, help="submissions graded at once (default 2)")
    parser.add_argument("--timeout", type=float, default=60, help="seconds per submission (default 60)")
    parser.add_argument("--keep", type=Path, help="build the course here and keep it (default: a temporary folder)")
    args = parser.parse_args(argv)
    if args.n < 1:
        parser.error("--n must be at least 1")
    with tempfile.TemporaryDirectory(prefix="grade-bench-") as tmp:
        course = classroom.new_course(args.keep or Path(tmp) / "course", [ASSIGNMENT])
        students = generate(course, args.n)
        kinds = Counter(s.kind for s in students.values())
        mix = ", ".join(f"{kinds[k]} {k}" for k in ("honest", "buggy", "blank", "hostile"))
        print(f"grade-bench: {args.n} {ASSIGNMENT} submissions ({mix}), --jobs {args.jobs}")
        worst = args.n * args.timeout / args.jobs + 600  # every submission using its whole time, plus start-up
        proc, wall = classroom.run_grader(course, ASSIGNMENT, jobs=args.jobs, timeout=args.timeout, limit=worst)
        rows = classroom.read_grades(course, ASSIGNMENT)
    if proc is None or proc.returncode != 0:
        tail = "" if proc is None else (proc.stdout + proc.stderr)[-2000:]
        print(f"the grading command {'stalled' if proc is None else f'exited with {proc.returncode}'}:\n{tail}")
    verdict = "met" if wall < WALL_TARGET else "MISSED"
    print(f"wall: {wall:.1f} s for {args.n} ({args.n / wall * 60:.1f} per minute); "
          f"target for 200: < {WALL_TARGET:.0f} s, {verdict if args.n == 200 else 'n/a at this n'}")
    seconds = per_submission_seconds(rows)
    if seconds.size:
        p50, p95 = np.percentile(seconds, [50, 95])
        print(f"per submission ({' + '.join(PHASES)}): p50 {p50:.2f} s, p95 {p95:.2f} s, max {seconds.max():.2f} s; "
              f"target p95 < {P95_TARGET:.0f} s: {'met' if p95 < P95_TARGET else 'MISSED'}")
    else:
        print(f"per submission: n/a (grades_{ASSIGNMENT}.csv has no {', '.join(PHASES)} columns)")
    problems = check(students, rows)
    print(f"rows: {len(rows)} for {args.n} submissions; every one exactly once with its expected score: "
          f"{'yes' if not problems else 'NO'}")
    for line in problems[:20]:
        print(f"  {line}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
