"""``python -m mha_lab grade [assignment] --course DIR --jobs N ...`` (``make grade A=...``): a class graded, then
the term's bookkeeping around it.

The engine (``mha_lab.grading.batch``) grades every submission of the assignment (of every assignment with
submissions when none is named), each in its own sandbox, and writes the gradebook and feedback; between the two
this command records submission times, extensions and late penalties (``term``), then prints the summary, writes
``grades_<a>.csv`` (``gradesheet``) and the class report ``reports/<a>/`` (``report``).
Exit status 0 when grading ran (whatever the students scored); 1 when it could not.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from mha_lab.grading import batch, course, judge, sandbox
from mha_lab.grading.abilities import CannotGradeError
from mha_lab.instructor import gradesheet, term
from mha_lab.instructor.report import build as build_report


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mha_lab grade", description=__doc__.splitlines()[0])
    parser.add_argument("assignment", nargs="?", help="e.g. ps1_per_head_loop (default: all with submissions)")
    parser.add_argument("--course", type=Path, default=Path.cwd(), help="course root (default: here)")
    parser.add_argument("--jobs", type=int, default=2, help="submissions graded at once (local Dask workers)")
    parser.add_argument("--student", action="append", help="grade only this student (repeatable)")
    parser.add_argument("--scheduler", help="address of a running Dask scheduler, e.g. tcp://host:8786")
    parser.add_argument("--dashboard", action="store_true", help="serve Dask's dashboard while grading (:8787, or "
                        "the next free port; its address is printed); none by default")
    parser.add_argument("--timeout", type=float, default=sandbox.Limits.seconds, help="seconds per submission")
    parser.add_argument("--memory", type=int, default=sandbox.Limits.memory, help="bytes of memory per submission")
    parser.add_argument("--memory-cgroup", type=Path, help="a cgroup v2 directory handed over to the grader for "
                        "the sandboxes' memory groups (README: grading on a cgroup v2 host)")
    parser.add_argument("--require-memory-measurement", action="store_true", help="refuse to grade an assignment "
                        "with memory checks on a host that cannot measure memory")
    parser.add_argument("--unsafe-no-sandbox", action="store_true", help="run student code unconfined (never "
                        "on untrusted submissions)")
    args = parser.parse_args(argv)
    root = args.course.resolve()
    if not (root / "nbgrader_config.py").is_file():
        parser.error(f"{root} is not a course folder (no nbgrader_config.py); pass --course DIR")
    if args.jobs < 1 or args.timeout <= 0 or args.memory <= 0:
        parser.error("--jobs, --timeout and --memory must be positive")
    todo = [args.assignment] if args.assignment else course.assignments(root)
    if not todo:
        parser.error(f"no submissions in {root / 'submitted'}")
    if args.assignment and not (root / "solutions" / args.assignment).is_dir():
        parser.error(f"no assignment {args.assignment!r} in {root / 'solutions'}")
    if not args.unsafe_no_sandbox and not args.scheduler:  # a cluster's workers say for themselves (abilities)
        try:
            sandbox.check()
        except sandbox.SandboxError as exc:
            parser.exit(1, f"cannot grade: {exc}\n")
    try:
        term.check(root, todo)
    except (ValueError, ImportError) as exc:
        parser.exit(1, f"cannot grade: {exc}\n")
    limits = sandbox.Limits(memory=args.memory, seconds=args.timeout, unsafe=args.unsafe_no_sandbox,
                            cgroup=str(args.memory_cgroup.resolve()) if args.memory_cgroup else "")
    mode = sandbox.memory_mode(limits)
    measuring = [a for a in todo if judge.measures_memory(judge.hidden_module(a, root))]
    if measuring and mode.parent is None and args.require_memory_measurement and not args.scheduler:
        parser.exit(1, f"cannot grade {', '.join(measuring)} with --require-memory-measurement: {mode}; grade as "
                       "root on cgroup v1, or pass --memory-cgroup DIR on cgroup v2 (README)\n")
    if measuring and not args.scheduler:
        print(f"memory: {mode}", flush=True)
    with batch.dask_client(args.jobs, args.scheduler, dashboard=args.dashboard) as client:
        if args.dashboard:
            print(f"Dask's dashboard: {client.dashboard_link}", flush=True)
        for a in todo:
            late: dict[str, term.Late] = {}  # filled between the gradebook and the feedback
            try:
                results = batch.grade_class(root, a, students=args.student, client=client, limits=limits,
                                            require_memory=args.require_memory_measurement,
                                            before_feedback=lambda who, a=a, late=late:
                                            late.update(term.apply(root, a, who)))
            except CannotGradeError as exc:
                parser.exit(1, f"cannot grade {a}: {exc}\n")
            out = root / f"grades_{a}.csv"
            print(gradesheet.summary_table(results, late=late, unsafe=limits.unsafe, details=out.name))
            gradesheet.write_csv(results, out, everyone=course.students(root), late=late)
            try:  # the grades are written: a report that cannot be made costs only itself
                written = f"the class report {build_report(root, a).relative_to(root)}/index.html"
            except Exception as exc:  # noqa: BLE001 - its reason is printed; make report A=... retries it
                written = f"no class report ({type(exc).__name__}: {exc})"
            print(f"\nwrote in {root}:\n  {out.name} (every score and message), gradebook.db, feedback/, "
                  f"autograded/\n  {written}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
