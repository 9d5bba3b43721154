"""Deliberately broken solutions: each mutant is one realistic bug in one answer cell.

``tests/mutants/<assignment>.py`` defines ``MUTANTS: list[Mutant]``. The grading pipeline test
applies each to the solution notebook and checks that exactly the ``breaks`` tests cells lose
their points and that the feedback names the bug.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mutant:
    """Replace ``old`` by ``new`` in the answer cell ``grade_id`` of the solution notebook.

    ``old`` must occur exactly once in that cell. ``breaks``: the grade_ids of the tests cells
    that must lose points (every other tests cell keeps full points). ``feedback``: a substring
    the student's feedback must contain (the name of the bug).
    """

    name: str
    grade_id: str
    old: str
    new: str
    breaks: frozenset[str]
    feedback: str

    def __post_init__(self) -> None:
        if self.old == self.new:
            raise ValueError(f"mutant {self.name}: old and new are the same text")
        if not self.breaks:
            raise ValueError(f"mutant {self.name}: breaks must name at least one tests cell")
        object.__setattr__(self, "breaks", frozenset(self.breaks))

    def apply(self, source: str) -> str:
        """The answer cell's source with the bug in; ValueError unless ``old`` occurs exactly once."""
        count = source.count(self.old)
        if count != 1:
            raise ValueError(f"mutant {self.name}: {self.old!r} occurs {count} times in cell {self.grade_id}")
        return source.replace(self.old, self.new)
