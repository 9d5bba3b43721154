"""Answers that are suspiciously alike: every pair of students, and every student against mha_lab's own code.

Answers are compared task by task (a task is one autograded answer cell, one graded function; the given
cells are not the student's) by copydetect's winnowing over tokens: names are replaced by one token
before fingerprinting, so renamed variables and reordered functions do not hide a copy. The release's
stub of each answer cell is boilerplate: its fingerprints never count. A pair's similarity is the
share of the two answers' tokens that also occur in the other one, summed over the tasks, so a short
function that everyone writes alike cannot flag a pair on its own:

    similarity(a, b) = sum_t (copied_t(a) + copied_t(b)) / sum_t (tokens_t(a) + tokens_t(b))

Against the package (``student_b`` = ``mha_lab``), only the student's side counts, over the tasks the
package implements (``PACKAGE_ANSWERS`` of the assignment's hidden module, task -> dotted names of the
package's functions): sum_t copied_t(a) / sum_t tokens_t(a). A pair is flagged at ``THRESHOLD`` or above.
"""

from __future__ import annotations

import importlib
import inspect
import io
import textwrap
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from itertools import combinations

import numpy as np
from copydetect import CodeFingerprint, compare_files

__all__ = ["PACKAGE", "THRESHOLD", "NOISE", "Pair", "package_source", "compare"]

PACKAGE = "mha_lab"  # student_b of a comparison with the package's own implementation
# Flag at half of the answers' tokens shared. Measured on ps3's three tasks (tests/test_instructor_report.py): a
# classmate's answers with every name changed and functions reordered score 0.99; the package's chunked_attention
# pasted (the other two tasks one's own) 0.71 against mha_lab; correct answers written independently 0.08 to 0.17
# against each other and 0 to 0.13 against the package; two of them sharing only an identical measure_peak 0.19.
THRESHOLD = 0.5
NOISE = 25  # copydetect's k: shortest run of (name-normalised) characters that counts as shared
WINDOW = 1  # winnowing window: every k-gram is a fingerprint (answers are short)


@dataclass
class Pair:
    """Two submissions (or one and the package) compared; ``tasks``: (task, similarity, answer a, answer b,
    spans of a and of b found in the other: (start, end) character offsets)."""

    student_a: str
    student_b: str
    similarity: float
    flagged: bool
    tasks: list[tuple[str, float, str, str, list[tuple[int, int]], list[tuple[int, int]]]] = field(default_factory=list)


def package_source(names: Iterable[str]) -> str:
    """The source of mha_lab's functions or methods named by dotted path (``mha_lab.cpu.split_heads``), joined."""
    sources = []
    for dotted in names:
        module_name, _, rest = dotted.partition(".")
        obj, parts = importlib.import_module(module_name), rest.split(".")
        while parts:  # the longest importable module, then attributes
            try:
                obj = importlib.import_module(f"{obj.__name__}.{parts[0]}")
            except ImportError:
                break
            parts.pop(0)
        for attr in parts:
            obj = getattr(obj, attr)
        sources.append(textwrap.dedent(inspect.getsource(obj)))
    return "\n\n".join(sources)


def _fingerprint(code: str, boilerplate: Iterable[int] = ()) -> CodeFingerprint:
    return CodeFingerprint("answer.py", NOISE, WINDOW, boilerplate=list(boilerplate), fp=io.StringIO(code))


class _Shares:
    """Fingerprints and overlaps, computed once per distinct answer and pair of answers (a generated class, or
    a class of copies, repeats them): (task, code a, code b) -> (copied tokens of a, of b, tokens of a, of b,
    copied spans of a, of b)."""

    def __init__(self, stubs: Mapping[str, str]) -> None:
        self.boiler = {t: _fingerprint(s).hashes for t, s in stubs.items()}
        self.prints: dict[tuple[str, str], CodeFingerprint] = {}
        self.done: dict[tuple[str, str, str], tuple] = {}

    def __call__(self, task: str, a: str, b: str) -> tuple[float, float, int, int, list, list]:
        if (task, a, b) not in self.done:
            for c in (a, b):
                if (task, c) not in self.prints:
                    self.prints[task, c] = _fingerprint(c, self.boiler.get(task, ()))
            x, y = self.prints[task, a], self.prints[task, b]
            shares, spans = (0.0, 0.0), ([], [])
            if x.token_coverage and y.token_coverage:
                _, shares, slices = compare_files(x, y)  # slices: 2 x n arrays of starts and ends in the code
                spans = tuple([(int(i), int(j)) for i, j in np.asarray(sl).reshape(2, -1).T] for sl in slices)
            self.done[task, a, b] = (shares[0] * x.token_coverage, shares[1] * y.token_coverage,
                                     x.token_coverage, y.token_coverage, *spans)
        return self.done[task, a, b]


def compare(answers: Mapping[str, Mapping[str, str]], stubs: Mapping[str, str],
            package: Mapping[str, str] | None = None) -> list[Pair]:
    """Every pair of ``answers`` (student -> task -> answer cell source), and each student against ``package``
    (task -> the package's source), highest similarity first. ``stubs``: task -> the release's answer cell."""
    shares = _Shares(stubs)
    pairs = [_pair(a, b, answers[a], answers[b], shares, both=True) for a, b in combinations(sorted(answers), 2)]
    if package:
        pairs += [_pair(a, PACKAGE, answers[a], package, shares, both=False) for a in sorted(answers)]
    return sorted(pairs, key=lambda p: (-p.similarity, p.student_a, p.student_b))


def _pair(a: str, b: str, sa: Mapping[str, str], sb: Mapping[str, str], shares: _Shares, *, both: bool) -> Pair:
    """Sum the copied and total tokens over the tasks both sides answered (``both``: count b's side too)."""
    copied = tokens = 0.0
    tasks = []
    for t in sorted(set(sa) & set(sb)):
        copied_a, copied_b, tokens_a, tokens_b, spans_a, spans_b = shares(t, sa[t], sb[t])
        if not tokens_a or not tokens_b:  # nothing of one's own (the stub as released)
            continue
        copied += copied_a + (copied_b if both else 0)
        tokens += tokens_a + (tokens_b if both else 0)
        tasks.append((t, (copied_a + copied_b) / (tokens_a + tokens_b) if both else copied_a / tokens_a, sa[t], sb[t],
                      spans_a, spans_b))
    similarity = float(copied / tokens) if tokens else 0.0
    return Pair(a, b, round(similarity, 4), similarity >= THRESHOLD, tasks)
