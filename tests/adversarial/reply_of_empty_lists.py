"""From inside ``split_heads``, write the grader a reply of its own on the worker's channel: 15 MiB of empty JSON
lists (five million of them), which a JSON parser turns into gigabytes of Python lists in the grader; then exit.

Stopped by: every answer is bounded in size and in structure (lists, objects and items counted, strings skipped)
before it is parsed; the grader stops the worker and records why, holding a few MiB at most.
"""

ASSIGNMENT = "ps1_per_head_loop"
EVERY_ANSWER_CELL = True


def cell(marker, port, course, repo, protect):
    import gc
    import os

    def split_heads(x, num_heads):
        channel = next(o for o in gc.get_objects() if type(o).__name__ == "_Grader").answers
        channel.write(b'{"ok": true, "result": [' + b"[]," * (5 * 2**20) + b'[]], "sizes": []}\n')
        channel.flush()
        os._exit(0)
