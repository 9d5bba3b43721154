"""Trace every frame (sys.settrace): make the checks' expected values equal the actual ones and their
conditions true, and replace builtins.AssertionError and sys.excepthook.

Stopped by: judging outside the sandbox: the tracer lives in the student's process; the checks run in the grader's.
"""


def cell(marker, port, course, repo, protect):
    import builtins
    import sys
    import threading

    def tracer(frame, event, arg):
        name = frame.f_code.co_filename
        if event == "line" and ("grading" in name or "hidden" in name or "testing" in name):
            local = frame.f_locals
            for actual, expected in (("actual", "expected"), ("actual", "desired"), ("out", "expected"),
                                     ("a", "b"), ("peak", "budget")):
                if actual in local and expected in local:
                    local[expected] = local[actual]
            if "condition" in local:
                local["condition"] = True
        return tracer

    class HarmlessError(Exception):
        pass

    sys.settrace(tracer)
    threading.settrace(tracer)
    builtins.AssertionError = HarmlessError
    sys.excepthook = lambda *args: None
