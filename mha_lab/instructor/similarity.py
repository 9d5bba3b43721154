"""Code that is suspiciously alike: every pair of students, and every student against mha_lab's own code.

A student's code is everything they wrote: every answer cell and every code cell of their own, wherever it
sits (a function moved into a cell before the first answer, each answer a one-line call, is still theirs).
It is compared as one text, whatever its order, by the k-grams of its normalised tokens: comments and
docstrings dropped, names other than attributes and builtins replaced by one token, string literals by
another, so renaming and reordering hide nothing. Given code is not the student's: a token is given when a
k-gram of the release's code (its given cells, tests and answer stubs) covers it, or when its line is one of
the release's (the signature the student started from); given tokens are never counted, and never
highlighted.

A side's *coverage* by another is the share of its own tokens that lie in a k-gram the other also has.
A pair's similarity is the larger coverage, containment in both directions, so code added to one side
(dead code, a helper never called) does not lower it:

    similarity(a, b) = max(covered(a by b) / own(a), covered(b by a) / own(b))

Against the package (``student_b`` = ``mha_lab``) the package's side is, per task, the functions named by
``PACKAGE_ANSWERS`` of the assignment's hidden module with every mha_lab function they call, transitively:
a paste of ``chunked_attention`` with ``online_softmax_step`` inlined is the package's code either way.
Per task, the student's function of that name with every function of theirs it calls (wherever it sits) is
compared with the package's both ways; the similarity is the largest. A pair is flagged when a share at
``THRESHOLD`` or above covers at least ``MIN_SHARED`` tokens, so that a short function everyone writes alike
cannot flag a pair on its own.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import inspect
import io
import keyword
import re
import textwrap
import tokenize
import types
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import combinations

import numpy as np

__all__ = ["PACKAGE", "THRESHOLD", "MIN_SHARED", "K", "Code", "Pair", "package_source", "compare"]

PACKAGE = "mha_lab"  # student_b of a comparison with the package's own implementation
K = 16  # tokens per k-gram: about two lines; shorter runs (``if mask is not None: s += mask``) are everyone's
# Measured on ps3: test_similarity_flags_copies_however_padded_or_moved (tests/test_instructor_report.py).
THRESHOLD = 0.5
MIN_SHARED = 60  # tokens of the covered side in shared k-grams, about five lines of code
MAX_CHARS = 200_000  # of a student's code compared (a notebook may hold 20 MiB): 50 times a full answer
_KEEP = frozenset(dir(builtins)) | frozenset(keyword.kwlist) | frozenset(keyword.softkwlist)
_STRINGS = {tokenize.STRING, getattr(tokenize, "FSTRING_START", tokenize.STRING)}  # f-strings: Python 3.12+
_SKIP = {tokenize.COMMENT, tokenize.NL, tokenize.INDENT, tokenize.DEDENT, tokenize.ENCODING, tokenize.ENDMARKER}


@dataclass(frozen=True)
class Code:
    """One side's code as shown: its text, its normalised tokens and where each lies in the text."""

    text: str
    tokens: tuple[str, ...]
    spans: tuple[tuple[int, int], ...]


@dataclass
class Pair:
    """Two submissions (or one and the package) compared: their code as shown, and the character spans of each
    that the other shares (student-written code only); empty for a pair of students ``compare`` does not show."""

    student_a: str
    student_b: str
    similarity: float
    flagged: bool
    code_a: str = ""
    code_b: str = ""
    spans_a: list[tuple[int, int]] = field(default_factory=list)
    spans_b: list[tuple[int, int]] = field(default_factory=list)


def tokenise(text: str) -> Code:
    """``text``'s tokens, normalised (names -> ``V`` but attributes and builtins, strings -> ``S``, docstrings
    and comments dropped, line ends kept); from where Python cannot tokenise on, words and symbols."""
    starts = _line_starts(text)
    tokens, spans = [], []
    try:
        previous, last, depth, keyword_at = tokenize.NEWLINE, "", 0, []
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type in _SKIP:
                continue
            if tok.type == tokenize.STRING and previous in (tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
                previous = tokenize.STRING  # a docstring, or a string alone as a statement: with its line end
                continue
            if tok.type == tokenize.NEWLINE and previous == tokenize.STRING and tokens[-1:] != ["S"]:
                previous = tokenize.NEWLINE
                continue
            previous = tok.type
            if tok.type == tokenize.NAME:
                norm = tok.string if tok.string in _KEEP or last == "." else "V"
                if depth and last in ("(", ","):
                    keyword_at.append(len(tokens))  # ``f(x, axis=-1)``: axis is kept if ``=`` follows
            elif tok.type in _STRINGS:
                norm = "S"
            else:
                norm = tok.string if tok.type != tokenize.NEWLINE else ";"
            if tok.string == "=" and keyword_at and keyword_at[-1] == len(tokens) - 1:
                tokens[-1] = last  # a keyword argument's name is the callee's, not the student's
            depth += {"(": 1, ")": -1}.get(tok.string, 0) if tok.type == tokenize.OP else 0
            last = tok.string
            tokens.append(norm)
            spans.append((int(starts[tok.start[0] - 1] + tok.start[1]), int(starts[tok.end[0] - 1] + tok.end[1])))
    except (tokenize.TokenError, IndentationError, SyntaxError):  # the rest, from the last token read
        rest = spans[-1][1] if spans else 0
        found = list(re.finditer(r"\w+|\S", text[rest:]))
        tokens += [m.group() if m.group() in _KEEP or not m.group()[0].isalpha() else "V" for m in found]
        spans += [(rest + m.start(), rest + m.end()) for m in found]
    return Code(text, tuple(tokens), tuple(spans))


def _line_starts(text: str) -> np.ndarray:
    """The offset of each line's first character, lines ending at ``\\n`` as tokenize and ast count them."""
    return np.array([0] + [m.end() for m in re.finditer("\n", text)], dtype=np.int64)


def _grams(code: Code) -> np.ndarray:
    """The hash of the k-gram that starts at each token (none when the code is shorter than K)."""
    n = len(code.tokens) - K + 1
    return np.array([hash(code.tokens[i:i + K]) for i in range(max(n, 0))], dtype=np.int64)


def _covered(grams: np.ndarray, chosen: np.ndarray, n_tokens: int) -> np.ndarray:
    """Per token: whether a k-gram whose hash is in ``chosen`` (sorted) covers it."""
    at = np.minimum(np.searchsorted(chosen, grams), max(len(chosen) - 1, 0))
    hit = (chosen[at] == grams).astype(np.int64) if len(chosen) else np.zeros(len(grams), np.int64)
    return np.convolve(hit, np.ones(K, dtype=np.int64))[:n_tokens] > 0 if len(hit) else np.zeros(n_tokens, bool)


class _Side:
    """A side of the comparisons: its code, k-grams, and which of its tokens are its own (not given)."""

    def __init__(self, text: str, given: np.ndarray, given_lines: frozenset[str] = frozenset()) -> None:
        self.code = tokenise(text)
        self.grams = _grams(self.code)
        lines = text.split("\n")
        line_of = np.searchsorted(_line_starts(text), [a for a, _ in self.code.spans], side="right") - 1
        on_given_line = np.array([lines[i].strip() in given_lines for i in line_of], bool)
        self.own = ~_covered(self.grams, given, len(self.code.tokens)) & ~on_given_line
        self.mine = np.setdiff1d(self.grams, given)  # k-grams that are not given

    def coverage(self, other: _Side, region: np.ndarray | None = None) -> tuple[float, int, np.ndarray]:
        """(share of own tokens covered by k-grams ``other`` has too, their number, which they are); only the
        tokens in ``region`` (a mask) count when it is given."""
        own = self.own if region is None else self.own & region
        shared = np.intersect1d(self.mine, other.mine, assume_unique=True)
        if not len(shared) or not own.any():
            return 0.0, 0, np.zeros(len(self.code.tokens), bool)
        hit = _covered(self.grams, shared, len(self.code.tokens)) & own
        return float(hit.sum()) / int(own.sum()), int(hit.sum()), hit

    def marks(self, hit: np.ndarray) -> list[tuple[int, int]]:
        """Character spans of the ``hit`` tokens, neighbours joined across whitespace only (a docstring or
        comment between them is not compared, so it is not marked)."""
        runs: list[tuple[int, int]] = []
        for i in np.flatnonzero(hit):
            start, end = self.code.spans[i]
            if runs and not self.code.text[runs[-1][1]:start].strip():
                runs[-1] = (runs[-1][0], end)
            else:
                runs.append((start, end))
        return runs

    def task(self, name: str) -> np.ndarray:
        """The tokens of function ``name`` and of every function of this code it calls, transitively (the task's
        code wherever the student put it); none when it defines no such function."""
        region = np.zeros(len(self.code.tokens), bool)
        defs = _definitions(self.code.text)
        token_starts = np.array([start for start, _ in self.code.spans], dtype=np.int64)
        todo, seen = [name], set()
        while todo:
            found = defs.get(todo.pop())
            if found is None or found[0] in seen:
                continue
            seen.add(found[0])
            region |= (token_starts >= found[0]) & (token_starts < found[1])
            todo += sorted(found[2] & defs.keys())
        return region


def _definitions(text: str) -> dict[str, tuple[int, int, set[str]]]:
    """Top-level function name -> (start, end) in ``text`` and the names its body uses. Code that does not parse
    as a whole is parsed piece by piece, a piece from each line that starts at the first column to the next."""
    try:
        pieces = [(0, ast.parse(text))]
    except (SyntaxError, ValueError):
        cuts = sorted({0, *(m.start() for m in re.finditer(r"^[^\s#)\]}]", text, re.M)), len(text)})
        pieces = []
        for lo, hi in zip(cuts, cuts[1:], strict=False):
            try:
                pieces.append((lo, ast.parse(text[lo:hi])))
            except (SyntaxError, ValueError):
                continue
    defs = {}
    for offset, tree in pieces:
        starts = _line_starts(text[offset:]) + offset
        for node in tree.body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                first = node.decorator_list[0] if node.decorator_list else node
                defs[node.name] = (int(starts[first.lineno - 1] + first.col_offset),
                                   int(starts[node.end_lineno - 1] + node.end_col_offset),
                                   {n.id for n in ast.walk(node) if isinstance(n, ast.Name)})
    return defs


def package_source(names: Iterable[str]) -> str:
    """The source of mha_lab's functions or methods named by dotted path (``mha_lab.cpu.split_heads``) and of
    every mha_lab function or method they call, transitively, each once."""
    sources: dict[str, str] = {}
    todo = [_resolve(dotted) for dotted in names]
    while todo:
        obj = todo.pop(0)
        key = f"{obj.__module__}.{obj.__qualname__}"
        if key in sources:
            continue
        sources[key] = textwrap.dedent(inspect.getsource(obj))
        todo += _callees(obj)
    return "\n\n".join(sources.values())


def _resolve(dotted: str) -> types.FunctionType:
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
    return obj


def _callees(fn: types.FunctionType) -> list[types.FunctionType]:
    """The functions and methods of mha_lab that ``fn`` calls by name (``f(...)``, ``module.f(...)``,
    ``self.f(...)``)."""
    fn = inspect.unwrap(fn)
    owner = None
    if "." in fn.__qualname__:  # a method: self.<name> is its class's
        owner = inspect.getmodule(fn)
        for part in fn.__qualname__.split(".")[:-1]:
            owner = getattr(owner, part, None)
    found = []
    for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(fn)))):
        if not isinstance(node, ast.Call):
            continue
        chain, target = [], node.func
        while isinstance(target, ast.Attribute):
            chain.insert(0, target.attr)
            target = target.value
        if not isinstance(target, ast.Name):
            continue
        obj = owner if target.id == "self" else fn.__globals__.get(target.id)
        for attr in chain:
            obj = getattr(obj, attr, None)
        obj = getattr(obj, "__func__", obj)
        if isinstance(obj, types.FunctionType) and obj.__module__.startswith(PACKAGE + "."):
            found.append(obj)
    return found


def compare(code: Mapping[str, str], given: Iterable[str], package: Mapping[str, str] | None = None,
            shown: int = 40) -> list[Pair]:
    """Every pair of students of ``code`` (student -> all the code they wrote, as one text), and each student
    against ``package`` (task -> the package's source for it), highest similarity first. ``given``: the
    release's code (given cells, tests cells, answer stubs). The code and its marks are filled in for every
    pair with the package and the ``shown`` most similar flagged pairs of students."""
    given = list(given)
    given_grams = np.unique(np.concatenate([_grams(tokenise(g)) for g in given] or [np.zeros(0, np.int64)]))
    given_lines = frozenset(line.strip() for g in given for line in g.splitlines()) - {""}
    sides = {s: _Side(text[:MAX_CHARS], given_grams, given_lines) for s, text in code.items()}
    pairs = [_pair(a, b, sides[a], sides[b]) for a, b in combinations(sorted(sides), 2)]
    for p in sorted((p for p in pairs if p.flagged), key=lambda p: -p.similarity)[:shown]:
        x, y = sides[p.student_a], sides[p.student_b]
        p.code_a, p.code_b, p.spans_a, p.spans_b = x.code.text, y.code.text, x.marks(x.coverage(y)[2]), \
            y.marks(y.coverage(x)[2])
    if package:
        whole = _Side("\n\n".join(package.values()), given_grams)
        tasks = {t: _Side(text, given_grams) for t, text in package.items()}
        pairs += [_against_package(s, sides[s], whole, tasks) for s in sorted(sides)]
    return sorted(pairs, key=lambda p: (-p.similarity, p.student_a, p.student_b))


def _flag(scores: Sequence[tuple[float, int]]) -> tuple[float, bool]:
    """(the largest share, whether any share at ``THRESHOLD`` or above covers ``MIN_SHARED`` tokens or more)."""
    return round(max(share for share, _ in scores), 4), any(x >= THRESHOLD and n >= MIN_SHARED for x, n in scores)


def _pair(a: str, b: str, x: _Side, y: _Side) -> Pair:
    return Pair(a, b, *_flag([x.coverage(y)[:2], y.coverage(x)[:2]]))


def _against_package(student: str, side: _Side, whole: _Side, tasks: Mapping[str, _Side]) -> Pair:
    """Per task, the student's function with what it calls against the package's with what it calls, both ways.
    The spans shown are the student's code found anywhere in the package's, and back."""
    scores = [(0.0, 0)]
    for name, package in tasks.items():
        region = side.task(name)
        if region.any():
            scores += [side.coverage(package, region)[:2], package.coverage(side)[:2]]
    return Pair(student, PACKAGE, *_flag(scores), side.code.text, whole.code.text,
                side.marks(side.coverage(whole)[2]), whole.marks(whole.coverage(side)[2]))
