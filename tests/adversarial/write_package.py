"""Write into the code the grader runs: append to mha_lab/grading/__init__.py and mha_lab/__init__.py, add a
module to the package, drop a .pth file into every site-packages, write into $HOME and /tmp.

Stopped by: the sandbox's read-only view of the interpreter, the package and the system; $HOME and /tmp are private.
"""


def cell(marker, port, course, repo, protect):
    import os
    import sys
    from pathlib import Path

    import mha_lab

    for package in {Path(mha_lab.__file__).resolve().parent, Path(repo) / "mha_lab"}:
        for target in (package / "grading" / "__init__.py", package / "__init__.py"):
            try:
                with open(target, "a") as f:
                    f.write(f"\n# {marker}\n")
            except OSError as err:
                print(f"{target}: {err}")
        try:
            (package / f"{marker}.py").write_text(f"# {marker}\n")
        except OSError as err:
            print(f"{package}: {err}")
    for entry in sys.path:
        if entry.endswith("site-packages"):
            try:
                (Path(entry) / f"{marker}.pth").write_text(f"# {marker}\n")  # a .pth line could import code
            except OSError as err:
                print(f"{entry}: {err}")
    for folder in (Path.home(), Path("/tmp"), Path(os.environ.get("TMPDIR", "/tmp"))):
        try:
            (folder / marker).write_text(marker)
        except OSError as err:
            print(f"{folder}: {err}")
