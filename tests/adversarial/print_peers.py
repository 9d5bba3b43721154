"""Print classmates' work: every notebook under the course's submitted/, autograded/ and feedback/ folders,
found by walking up from the working directory and at the course's real path.

Stopped by: the sandbox, whose only view of submissions is a copy of this student's own folder.
"""


def cell(marker, port, course, repo, protect):
    from pathlib import Path

    roots = [Path(course), *Path.cwd().resolve().parents]
    for root in roots:
        for folder in ("submitted", "autograded", "feedback"):
            for path in sorted((root / folder).glob("*/*/*")):
                try:
                    print(f"==> {path}\n{path.read_text()[:200_000]}")
                except OSError as err:
                    print(f"{path}: {err}")
