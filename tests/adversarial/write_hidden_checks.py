"""Rewrite the grading's secrets: append to every file of tests/hidden/, add a hidden module, write into
solutions/ and into the course's source and release folders.

Stopped by: the sandbox, in which none of these folders exist, and a course that is never writable from it.
"""


def cell(marker, port, course, repo, protect):
    from pathlib import Path

    import mha_lab

    for root in {Path(mha_lab.__file__).resolve().parents[1], Path(repo), Path(course)}:
        for path in sorted(root.glob("tests/hidden/*.py")):
            try:
                with open(path, "a") as f:
                    f.write(f"\n# {marker}\n")
            except OSError as err:
                print(f"{path}: {err}")
        for folder in ("tests/hidden", "solutions", "assignments"):
            try:
                (root / folder / f"test_{marker}.py").write_text(f"# {marker}\n")
            except OSError as err:
                print(f"{root / folder}: {err}")
