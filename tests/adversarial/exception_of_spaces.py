"""Every function raises an exception whose message is 1,000,000 spaces then ``x``: an expression that matches
spaces before a bug tag (``\\s*\\[bug: ...``) backtracks quadratically over them in the grader, about 25
minutes per failing call, outside the sandbox's deadline.

Stopped by: every message is cut to a fixed length before any expression reads it, and the bug tags are cut out
by position; the class is graded in seconds and the feedback shows the head of the message.
"""

ASSIGNMENT = "ps1_per_head_loop"
EVERY_ANSWER_CELL = True


def cell(marker, port, course, repo, protect):
    def _spaces(*args, **kwargs):
        raise ValueError(" " * 1_000_000 + "x")

    split_heads = merge_heads = attention = mha_forward_loop = _spaces  # noqa: F841 - the notebook's names
