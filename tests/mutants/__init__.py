"""Deliberately broken solutions, and correct ones written differently.

``tests/mutants/<assignment>.py`` defines ``MUTANTS: list[Mutant]`` and ``VARIANTS: list[Variant]``.
The grading pipeline test applies each mutant to the solution notebook and checks that exactly
the ``breaks`` tests cells lose their points and that the feedback names the bug; each variant
must get full marks, since a correct answer that loses points is as wrong as a bug that keeps them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

# The feedback of a mutant that takes its answer from mha_lab: the sandbox does not hold the package.
NOT_AVAILABLE = "mha_lab is not available when graded: write the function yourself"


@dataclass(frozen=True)
class Mutant:
    """Replace ``old`` by ``new`` in the answer cell ``grade_id`` of the solution notebook.

    ``old`` must occur exactly once in that cell. ``breaks``: the grade_ids of the tests cells
    that must lose points (every other tests cell keeps full points). ``feedback``: a substring
    the student's feedback must contain (the name of the bug). ``bug``: the id the class report must
    group it under, and nothing else (a misconception named in every task it can occur in).
    """

    name: str
    grade_id: str
    old: str
    new: str
    breaks: frozenset[str]
    feedback: str
    bug: str = ""

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


@dataclass(frozen=True)
class Variant:
    """A correct solution written another way: ``answers`` maps answer-cell grade_ids to their whole source.

    Answer cells not named keep the reference solution's source.
    """

    name: str
    answers: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.answers:
            raise ValueError(f"variant {self.name}: answers must replace at least one answer cell")
