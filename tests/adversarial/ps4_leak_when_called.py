"""Leak from inside a graded function: when a check calls it, read tests/hidden/ and return the text, and
rewrite every gradebook in the course.

Stopped by: the worker's sandbox, which sees neither tests/hidden/ nor the course; a string is a wrong answer.
"""

ASSIGNMENT = "ps4_backward"
EVERY_ANSWER_CELL = True


def cell(marker, port, course, repo, protect):
    def _leak(*args, **kwargs):
        import sqlite3
        from pathlib import Path

        for db in Path(course).glob("*.db"):
            try:
                with sqlite3.connect(db, timeout=5) as con:
                    con.execute("UPDATE grade SET auto_score = 1000")
            except sqlite3.Error:
                pass
        return "\n".join(p.read_text() for p in sorted(Path(repo).glob("tests/hidden/*.py")))

    mha_backward = numerical_gradient = gradient_check = _leak  # noqa: F841 - module-level names in the notebook
