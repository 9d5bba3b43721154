"""``numerical_gradient`` computes no difference at all: it returns the exact gradient that the hidden check's loss
object carried into the sandbox, ``f.exact()`` (3 points for no finite differences).

Stopped by: only ``x`` crosses into the sandbox: the object there is the worker's, which knows its value and
nothing of its gradient, so the call raises and the numerical-gradient cells earn nothing.
"""

ASSIGNMENT = "ps4_backward"
EVERY_ANSWER_CELL = True


def cell(marker, port, course, repo, protect):
    def numerical_gradient(f, x, eps=1e-5):
        exact = getattr(f, "exact", None)
        if exact is None:
            raise AttributeError(f"no exact gradient on {type(f).__name__}: {type(f).__doc__}")
        return exact()
