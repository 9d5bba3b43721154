"""Command line: ``python -m mha_lab bench [--quick] [--gpu] [--out DIR]``.

``--gpu`` hands the other options to ``mha_lab.cuda.bench_gpu.main`` (PyTorch and Triton on
an NVIDIA GPU) instead of running the CPU suite.
"""

from __future__ import annotations

import sys


def _bench_gpu(argv: list[str]) -> int:
    """Run ``mha_lab.cuda.bench_gpu.main(argv)``, or explain why it cannot run here; returns the exit status."""
    try:
        import torch
    except ImportError:
        print("--gpu needs PyTorch: pip install torch", file=sys.stderr)
        return 1
    if not torch.cuda.is_available():
        print("--gpu needs a CUDA GPU, and torch.cuda.is_available() is False on this machine", file=sys.stderr)
        return 1
    try:
        from mha_lab.cuda import bench_gpu
    except ImportError as err:
        print(f"--gpu: the GPU benchmark (mha_lab.cuda.bench_gpu) cannot be imported: {err}", file=sys.stderr)
        return 1
    return bench_gpu.main(argv)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] != "bench":
        print(__doc__.strip(), file=sys.stderr)
        return 2
    argv = argv[1:]
    if "--gpu" in argv:
        return _bench_gpu([a for a in argv if a != "--gpu"])
    from mha_lab.bench import main as bench_main

    bench_main(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
