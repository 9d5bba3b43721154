"""MHA Lab's command line: ``python -m mha_lab COMMAND [options]``; ``COMMAND --help`` describes each.

A command is one line of ``COMMANDS``: its name, the function that runs it on the remaining
arguments (usually a module's ``main(argv)``, imported only when the command runs) and a line
of help. The command line is the top of the package: it may import anything, nothing imports it.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable


def _module(name: str) -> Callable[[list[str]], int]:
    """The command whose code is ``name.main(argv) -> int``; the module is imported when the command runs."""
    return lambda argv: importlib.import_module(name).main(argv)


def _bench(argv: list[str]) -> int:
    """``bench``: the suite and its tables (``mha_lab.bench``), then its figures (``mha_lab.plots.bench``)."""
    if "--gpu" in argv:  # PyTorch and Triton on an NVIDIA GPU
        return _module("mha_lab.cuda.bench_gpu")([a for a in argv if a != "--gpu"])
    from mha_lab import bench
    from mha_lab.plots.bench import save_figures

    results, out = bench.main(argv)
    print(f"wrote {out / 'bench.json'}, {out / 'bench.md'}, " + ", ".join(p.name for p in save_figures(results, out)))
    return 0


COMMANDS: dict[str, tuple[Callable[[list[str]], int], str]] = {
    "bench": (_bench, "time and measure every attention implementation side by side (--gpu: the Triton kernel)"),
    "compile": (_module("mha_lab.cuda.compiled"),
                "build the Triton kernel for an A100 and an H100 without a GPU: shared memory, registers, spills"),
    "course": (_module("mha_lab.instructor.course_folder"),
               "course init DIR: a course folder of its own, outside the project, where a term is run"),
    "due": (_module("mha_lab.instructor.term"), "set or move an assignment's due date in the gradebook (due A DATE)"),
    "grade": (_module("mha_lab.instructor.grade"),
              "grade submissions, each in a sandbox, judged outside it (make grade A=...; --help for options)"),
    "report": (_module("mha_lab.instructor.report"),
               "the class report of a graded assignment: scores, cells, misconceptions, similar answers (make report)"),
    "decode": (_module("mha_lab.plots.decode"),
               "time one decoding step against context length (MHA, GQA, MQA) and print decode's FLOPs per byte"),
    "release-values": (_module("mha_lab.instructor.release_values"),
                       "store the expected values of the releases' visible tests with the sources (make assignments)"),
    "student-pack": (_module("mha_lab.instructor.student_pack"),
                     "zip the release notebooks and the package they import: no solutions, no hidden checks"),
    "grade-bench": (_module("mha_lab.instructor.grade_bench"),
                    "grade a generated class of 200 ps1 submissions and time it (--n for fewer)"),
    "export": (_module("mha_lab.instructor.export"),
               "grades into the LMS: fill a Canvas gradebook export for import (--canvas, --out), or a long CSV"),
    "cp": (_module("mha_lab.parallel.context_check"),
           "context-parallel attention (ring, Ulysses) on spawned ranks or under torchrun, checked on one device"),
    "train": (_module("mha_lab.model.train"),
              "train the course's small byte-level language model (pretrain, long-context fine-tunes, GQA)"),
    "lm-eval": (_module("mha_lab.model.evaluate"),
                "measure the trained model under sinks, windows, quantised caches, RoPE scalings and GQA (JSON)"),
    "tp": (_module("mha_lab.parallel.check"),
           "tensor-parallel attention on spawned ranks (or under torchrun), checked against one device"),
}


def main(argv: list[str] | None = None) -> int:
    """Parse the command name and hand every other argument to that command; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m mha_lab", description="MHA Lab's commands; "
                                     "`python -m mha_lab COMMAND --help` describes each.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (_, summary) in COMMANDS.items():
        commands.add_parser(name, help=summary, add_help=False)  # the command's own parser answers --help
    args, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    return COMMANDS[args.command][0](rest)


if __name__ == "__main__":
    sys.exit(main())
