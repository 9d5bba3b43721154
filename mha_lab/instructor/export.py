"""``python -m mha_lab export``: final scores, after late penalties, into the LMS.

``--canvas EXPORT --out FILE`` fills the gradebook Canvas exports, ``--long FILE`` writes one row per student
and assignment for any other LMS (both ``mha_lab.instructor.lms``), ``--lti CONFIG A...`` posts the scores
over LTI 1.3 (``mha_lab.instructor.lti``).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from mha_lab.instructor import lti
from mha_lab.instructor.lms import Grade, canvas, read_grades, write_long

__all__ = ["main"]


def _post_lti(args: argparse.Namespace, grades: dict[tuple[str, str], Grade]) -> int:
    """``--lti``: post the final scores of ``args.assignments`` (default: every one graded) to the platform, saying
    each step as it is done; with ``--dry-run`` contact nothing and say the plan."""
    reg = lti.load(args.lti)
    client = lti.Client(reg, allow_http=args.allow_http, dry_run=args.dry_run)
    members = lti.read_roster(args.roster, reg.match) if args.roster else None
    todo = args.assignments or sorted({a for (_, a), g in grades.items() if g.status == "graded"})
    out = lti.post_grades(client, grades, todo, members=members)
    if out.unmatched_students:
        where = "the roster file" if args.roster else "the platform's roster"
        print(f"note: graded but not on {where}: {', '.join(out.unmatched_students)}")
    if out.unmatched_members:
        print(f"note: learners on the roster that match no student: {', '.join(out.unmatched_members)}")
    for student, assignment, reason in out.failed:
        print(f"FAILED {assignment} {student}: {reason}", file=sys.stderr)
    if out.failed:
        print(f"{len(out.failed)} scores not posted: run the same command again to post them", file=sys.stderr)
    return 1 if out.failed else 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mha_lab export", description=__doc__.splitlines()[0])
    parser.add_argument("assignments", nargs="*", help="with --lti: the assignments to post (default: all graded)")
    parser.add_argument("--course", type=Path, default=Path.cwd(), help="course root (default: here)")
    parser.add_argument("--canvas", type=Path, help="the gradebook CSV Canvas exports: the roster")
    parser.add_argument("--out", type=Path, help="the Canvas import to write (with --canvas)")
    parser.add_argument("--id-column", default="SIS Login ID",
                        help="the Canvas column that holds the nbgrader student id (default: %(default)s)")
    parser.add_argument("--long", type=Path, help="also write one row per student and assignment here")
    parser.add_argument("--lti", type=Path, metavar="CONFIG", help="post final scores over LTI 1.3 AGS with the "
                        "tool registration in this TOML file (see mha_lab.instructor.lti)")
    parser.add_argument("--dry-run", action="store_true", help="with --lti: contact nothing (no token, no roster) "
                        "and print, in order, what a run would do")
    parser.add_argument("--roster", type=Path, metavar="FILE", help="with --dry-run: match the scores against this "
                        "roster: the NRPS membership container as JSON ({\"members\": [...]}, or the bare list), or a "
                        ".csv whose header names user_id, the match field (lis_person_sourcedid by default) and "
                        "optionally roles (space-separated; default Learner) and status (default Active)")
    parser.add_argument("--allow-http", action="store_true", help="with --lti: accept http:// endpoints on a host "
                        "that is not this machine (the token and the scores then cross the network in clear)")
    parser.add_argument("--lti-jwks", type=Path, metavar="CONFIG", help="print the tool's public key set, "
                        "to register the tool with the platform")
    args = parser.parse_args(argv)
    if args.lti_jwks:
        print(json.dumps(lti.public_key_set(lti.load(args.lti_jwks)), indent=2))
        return 0
    if args.canvas is None and args.long is None and args.lti is None:
        parser.error("nothing to write: give --canvas FILE --out FILE, --long FILE, --lti CONFIG, or several")
    if (args.canvas is None) != (args.out is None):
        parser.error("--canvas and --out go together")
    if (args.assignments or args.dry_run or args.allow_http) and args.lti is None:
        parser.error("assignments, --dry-run and --allow-http go with --lti")
    if args.roster and not args.dry_run:
        parser.error("--roster goes with --dry-run (a run reads the roster from the platform)")
    try:
        grades = read_grades(args.course)
        if args.long:
            write_long(grades, args.long)
            print(f"wrote {args.long}: {len(grades)} rows")
        if args.canvas:
            for note in canvas(args.canvas, grades, args.out, args.id_column):
                print(f"note: {note}")
            print(f"wrote {args.out}: import it in Canvas (Grades, Import)")
        if args.lti:
            return _post_lti(args, grades)
    except (OSError, ValueError, RuntimeError) as exc:
        print(f"export: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
