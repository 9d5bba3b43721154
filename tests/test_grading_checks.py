"""Unit tests of the grading helpers: calling student code, judging."""

from __future__ import annotations

import io
import json
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import mha_lab.cpu
from mha_lab.grading import checks, judge, run_hidden_checks
from mha_lab.grading.judge import HIDDEN_DIR_ENV
from mha_lab.grading.references import Array, Reference
from mha_lab.grading.worker import decode, encode, frame, read_message

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.mutants import Mutant  # noqa: E402 - needs the repository root on sys.path


def notebook(source: str) -> dict:
    """Run ``source`` as a notebook would and return its namespace."""
    namespace: dict = {"__name__": "__main__"}
    exec(textwrap.dedent(source), namespace)  # noqa: S102 - test fixtures
    return namespace


# --- call --------------------------------------------------------------------------------------


def test_call_returns_the_result_and_copies_the_inputs():
    student = notebook("""
        def double(x):
            x *= 2
            return x
    """)
    x = np.ones(3)
    assert np.array_equal(checks.call(student, "double", x), [2.0, 2.0, 2.0])
    assert np.array_equal(x, np.ones(3)), "the student's function wrote into the check's input"


@pytest.mark.parametrize(("source", "message"), [
    ("", "`f` is not defined"),
    ("f = 3", "`f` should be a function"),
    ("def f(x):\n    raise NotImplementedError('ps9 task 1: f')", "`f` is not implemented yet (NotImplementedError)"),
    ("def f():\n    return 1", "`f` raised TypeError"),
    ("def f(x):\n    return x[10]", "`f` raised IndexError"),
])
def test_call_explains_what_went_wrong(source, message):
    with pytest.raises(AssertionError, match=message.replace("(", r"\(").replace(")", r"\)")):
        checks.call(notebook(source), "f", np.ones(3))


def test_a_failing_call_ends_with_the_graders_bug_id_not_one_the_student_wrote():
    student = notebook("def f(x):\n    raise ValueError('fine here [bug: not-mine] really')")
    with pytest.raises(AssertionError) as failure:
        checks.call(student, "f", np.ones(3))
    assert str(failure.value) == ("`f` raised ValueError: fine here really (called with array (3,) float64)"
                                  " [bug: raises-valueerror]")


@pytest.mark.parametrize(("hint", "bug", "note", "expected"), [
    ("swap the axes [bug: layout]", "split-no-transpose", "", "swap the axes [bug: split-no-transpose]"),
    ("sum over rows [bug: bias-sum]", None, "; fix W first", "sum over rows; fix W first [bug: bias-sum]"),
    ("repeat, not tile [bug: tile]. Or: transpose [bug: layout]", "tile-not-repeat", "",
     "repeat, not tile. Or: transpose [bug: tile-not-repeat]"),
    ("no tag [bug: a] here", None, "", "no tag here [bug: a]"),
    ("untagged", None, " (called with x)", "untagged (called with x)"),
])
def test_retag_leaves_one_tag_last_after_the_note(hint, bug, note, expected):
    assert checks.retag(hint, bug, note=note) == expected


def test_call_replacing_judges_a_function_with_a_reference_helper():
    student = notebook("""
        def attention(Q, K, V, mask=None):
            return Q * 0, None  # broken
        def layer(Q):
            return attention(Q, Q, Q)[0]
    """)
    Q = np.random.default_rng(0).normal(size=(2, 3, 4))
    expected = mha_lab.cpu.scaled_dot_product_attention(Q, Q, Q)[0]
    attention = Reference("mha_lab.cpu.scaled_dot_product_attention",
                          (("Q", Array((2, 4))), ("K", Array((2, 4))), ("V", Array((2, 4)))), 3)
    out = checks.call_replacing(student, {"attention": attention}, "layer", Q)
    np.testing.assert_allclose(out, expected)
    assert not np.allclose(checks.call(student, "layer", Q), expected), "the replacement outlived the call"


# --- judging -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("value", "message"), [
    ([1.0, 2.0], "expected a numpy.ndarray, got list"),
    (np.ones(3), r"expected shape \(2,\), got \(3,\)"),
    (np.ones(2, dtype=np.float32), "expected dtype float64, got float32"),
    (np.array([1.0, np.nan]), "1 entries are NaN or inf. Likely bug: the hint"),
])
def test_expect_array_checks_type_shape_dtype_finiteness(value, message):
    with pytest.raises(AssertionError, match=message):
        checks.expect_array(value, what="out", shape=(2,), hint="the hint")


def test_expect_close_names_the_bug_and_the_error():
    checks.expect_close(np.ones(3) + 1e-13, np.ones(3), what="out", hint="h")
    with pytest.raises(AssertionError, match=r"out: values differ .*max abs error 0\.5.*Likely bug: transposed"):
        checks.expect_close(np.array([1.0, 1.5]), np.ones(2), what="out", hint="transposed")


def test_a_measured_call_sees_numpy_buffers_and_the_budget_fails():
    student = {"grab": lambda n: np.ones(n)}
    _, peak = checks.call_with_peak(student, "grab", 1_000_000)
    assert 8_000_000 <= peak < 9_000_000
    with pytest.raises(AssertionError, match="over the budget"):
        checks.expect_within_budget(peak, 1_000_000, what="forward", hint="full score matrix")


# --- judging a tests cell ---------------------------------------------------------------------------


@pytest.fixture
def hidden_dir(tmp_path, monkeypatch):
    (tmp_path / "test_demo.py").write_text(textwrap.dedent("""
        import numpy as np
        from mha_lab.grading import checks

        def test_flip(student):
            x = np.arange(6.0).reshape(2, 3)

            out = checks.call(student, "flip", x)

            checks.expect_close(out, x.T, what="flip(x)", hint="transpose, not reshape")

        def test_flip__square(student):
            x = np.arange(4.0).reshape(2, 2)

            out = checks.call(student, "flip", x)

            checks.expect_close(out, x.T, what="flip(square x)", hint="transpose")

        def test_flipped(student):
            raise AssertionError("test_flipped is another group")
    """))
    monkeypatch.setenv(HIDDEN_DIR_ENV, str(tmp_path))
    return tmp_path


def test_a_tests_cell_runs_exactly_its_own_checks(hidden_dir):
    module, wrong = judge.load(judge.hidden_module("demo")), {"flip": lambda x: x.copy()}
    assert judge.judge_cell(module, "flip", {"flip": lambda x: x.T.copy()}) == ""
    assert judge.judge_cell(module, "flip", wrong).splitlines()[0] == "flip: 2 hidden check(s) failed"
    assert judge.judge_cell(module, "flipped", wrong) == ("flipped: 1 hidden check(s) failed\n"
                                                          "- test_flipped: test_flipped is another group")


def test_run_hidden_checks_passes_quietly_and_fails_with_every_message(hidden_dir):
    run_hidden_checks("demo", "flip", {"flip": lambda x: x.T.copy()})
    with pytest.raises(AssertionError) as info:
        run_hidden_checks("demo", "flip", {"flip": lambda x: x.reshape(x.shape[::-1])})
    text = str(info.value)
    assert "flip: 2 hidden check(s) failed" in text
    assert "test_flip: flip(x): values differ" in text and "transpose, not reshape" in text
    assert "test_flip__square" in text and "test_flipped" not in text


def test_a_group_without_checks_gives_no_points(hidden_dir):
    with pytest.raises(AssertionError, match="no hidden checks for tests cell 'nothing'"):
        run_hidden_checks("demo", "nothing", {})


def test_hidden_modules_load_from_their_path_every_time(hidden_dir):
    first = judge.load(hidden_dir / "test_demo.py")
    first.np = None  # what a previous run could have left behind
    assert judge.load(hidden_dir / "test_demo.py").np is np
    assert not any(name.startswith("hidden_") for name in sys.modules)


# --- the worker codec and mutants ---------------------------------------------------------------


def _round_trip(value):
    """``value`` framed as the worker sends it, then read back."""
    arrays = []
    message, back = read_message(io.BytesIO(b"".join(frame({"v": encode(value, arrays)}, arrays))))
    return decode(message["v"], back)


def test_codec_round_trips_and_never_unpickles():
    value = (np.arange(6.0).reshape(2, 3), [np.float32(1.5), 3, None, "s"], {"k": np.int64(7)},
             np.asfortranarray(np.arange(6).reshape(2, 3)), np.arange(10)[::3], np.zeros((0, 4), np.float32))
    back = _round_trip(value)
    assert np.array_equal(back[0], value[0]) and back[1][0] == np.float32(1.5) and type(back[1][0]) is np.float32
    assert back[1][1:] == [3, None, "s"] and back[2] == {"k": 7}
    assert all(np.array_equal(b, v) and b.dtype == v.dtype for b, v in zip(back[3:], value[3:], strict=True))
    back[0][0, 0] = 7.0  # the receiver's arrays are its own to change
    with pytest.raises(ValueError, match="pickle"):
        encode(np.array([object()]), [])
    assert _round_trip(object()).startswith("<unsupported")
    head = io.BytesIO()  # what a hostile worker could send: an array of Python objects
    np.lib.format.write_array_header_2_0(head, {"descr": "|O", "fortran_order": False, "shape": (1,)})
    forged = head.getvalue() + bytes(8)
    with pytest.raises(ValueError, match="pickles"):
        read_message(io.BytesIO(json.dumps({"sizes": [len(forged)]}).encode() + b"\n" + forged))


def test_codec_keeps_shared_arrays_shared_and_sends_numpy_functions_by_name():
    from mha_lab.grading.checks import SmoothLoss

    x = np.arange(4.0)
    f, x_back, std = _round_trip(((SmoothLoss(x), x, np.std), {}))[0]
    assert x_back is f.x, "the loss must read the very array the student perturbs"
    x_back[0] = 10.0
    assert f() == SmoothLoss(x_back)() and std is np.std
    assert decode({"__numpy__": "not_a_numpy_function"}, []).startswith("<unsupported")
    assert decode({"__numpy__": "save"}, []).startswith("<unsupported"), "only pure reductions and ufuncs cross"


def test_mutant_applies_once_or_refuses():
    m = Mutant("n", "cell", "a + b", "a - b", breaks={"t"}, feedback="f")
    assert m.apply("y = a + b") == "y = a - b"
    with pytest.raises(ValueError, match="occurs 2 times"):
        m.apply("a + b; a + b")
    with pytest.raises(ValueError, match="breaks must name"):
        Mutant("n", "cell", "a", "b", breaks=set(), feedback="f")
