"""Symlinks in the submission folder to the hidden checks, a solution, the gradebook, a classmate's folder and
the package; the notebook reads through them, prints what it finds and writes through them.

Stopped by: a copy of the folder into the sandbox that keeps links as links, whose targets do not exist there.
"""


def cell(marker, port, course, repo, protect):
    import sqlite3
    from pathlib import Path

    for link in sorted(Path.cwd().iterdir()):
        if not link.is_symlink():
            continue
        target = link / "ps1_per_head_loop.ipynb" if link.is_dir() else link
        try:
            print(f"==> {link}\n{target.read_text(errors='replace')[:200_000]}")
        except OSError as err:
            print(f"{link}: {err}")
    for name in ("hidden.py", "solution.ipynb"):
        try:
            with open(name, "a") as f:
                f.write(f"\n# {marker}\n")
        except OSError as err:
            print(f"{name}: {err}")
    try:
        (Path("package") / f"{marker}.py").write_text(f"# {marker}\n")
    except OSError as err:
        print(f"package: {err}")
    try:
        with sqlite3.connect("gradebook.db", timeout=5) as con:
            con.execute("UPDATE grade SET auto_score = 1000")
    except sqlite3.Error as err:
        print(f"gradebook.db: {err}")


def prepare(folder, nb, target):
    """Links next to the notebook, as a zip or tar of the student's folder can carry them."""
    from pathlib import Path

    repo, course = Path(target.repo), Path(target.course)
    links = {"hidden.py": repo / "tests" / "hidden" / "test_ps1_per_head_loop.py",
             "solution.ipynb": repo / "solutions" / "ps1_per_head_loop" / "ps1_per_head_loop.ipynb",
             "gradebook.db": course / "gradebook.db", "package": repo / "mha_lab"}
    peers = sorted(p for p in (course / "submitted").iterdir() if p.name != folder.parent.name)
    links.update({f"peer-{p.name}": p / "ps1_per_head_loop" for p in peers})
    for name, to in links.items():
        (folder / name).symlink_to(to)
