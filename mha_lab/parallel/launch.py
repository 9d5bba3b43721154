"""Start the ranks of a ``torch.distributed`` job on this machine, or join the job ``torchrun`` started.

``spawn(fn, world_size)`` runs ``fn(device, *args)`` on ``world_size`` fresh processes joined in
one process group on the loopback interface (gloo with CPU tensors; NCCL, one GPU per rank,
when there are enough GPUs), and returns what each rank returned. Under ``torchrun`` the
process group already has its rank and address in the environment: ``init_from_env`` joins it.
Every collective carries the timeout, so a rank that never arrives fails the job instead of
hanging it.
"""

from __future__ import annotations

import argparse
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mha_lab.measure import usable_cores

__all__ = ["spawn", "init_from_env", "under_torchrun", "free_port", "pick_device", "add_launch_arguments",
           "launch_world_size"]

DEVICES = ("auto", "cpu", "cuda")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def under_torchrun() -> bool:
    """True in a process that ``torchrun`` started: the rendezvous is in the environment."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def pick_device(device: str, local_world_size: int, local_rank: int) -> torch.device:
    """``cuda:local_rank`` for "cuda", or for "auto" when every local rank gets its own GPU; else the CPU."""
    if device not in DEVICES:
        raise ValueError(f"device must be one of {DEVICES}, got {device!r}")
    gpus = torch.cuda.device_count()
    if device == "cuda" and gpus < local_world_size:
        raise ValueError(f"device='cuda' needs one GPU per rank: {local_world_size} ranks, {gpus} GPUs")
    if device == "cuda" or (device == "auto" and gpus >= local_world_size):
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def _backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def init_from_env(device: str = "auto", timeout: float = 120.0) -> torch.device:
    """Join the process group ``torchrun`` describes in the environment; returns this rank's device."""
    local = pick_device(device, int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"])),
                        int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(_backend(local), timeout=timedelta(seconds=timeout))
    return local


def _entry(rank: int, fn: Callable, world_size: int, port: int, device: str, timeout: float, args: tuple,
           results) -> None:
    """One spawned rank: join the group on 127.0.0.1, run ``fn``, send back its value or its traceback."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo's own connections stay on the loopback too
    torch.set_num_threads(max(1, usable_cores() // world_size))  # the ranks share this process's cores
    try:
        local = pick_device(device, world_size, rank)
        dist.init_process_group(_backend(local), init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=timeout))
        try:
            results.put((rank, True, fn(local, *args)))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 (the parent re-raises it with the rank named)
        results.put((rank, False, traceback.format_exc()))


def spawn(fn: Callable, world_size: int, args: tuple = (), timeout: float = 120.0, device: str = "auto",
          start_method: str = "spawn") -> list:
    """Run ``fn(device, *args)`` on ``world_size`` new processes in one process group; their return values by rank.

    ``fn`` must be importable (a module-level function) and return something picklable. A rank
    that raises, or a job still running after ``timeout`` seconds, stops every rank and raises
    here, naming the rank. ``start_method="fork"`` (CPU only) starts ranks that inherit the
    parent's imports instead of importing PyTorch again, seconds saved per rank on a small machine.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    ctx = mp.get_context(start_method)
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, fn, world_size, port, device, timeout, args, results), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    deadline, values = time.monotonic() + timeout, {}
    try:
        while len(values) < world_size:
            try:
                rank, ok, value = results.get(timeout=min(1.0, max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead:  # a rank that died before it could report (killed, crashed at start-up)
                    raise RuntimeError(f"rank {dead[0][0]} of {world_size} exited with code {dead[0][1]} "
                                       "without a result") from None
                if time.monotonic() < deadline:
                    continue
                missing = sorted(set(range(world_size)) - set(values))
                raise TimeoutError(f"ranks {missing} of {world_size} did not finish within {timeout:.0f} s") from None
            if not ok:
                raise RuntimeError(f"rank {rank} of {world_size} failed:\n{value}")
            values[rank] = value
    finally:
        for p in procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()) if len(values) == world_size else 0)
            if p.is_alive():
                p.kill()
                p.join()
    return [values[r] for r in range(world_size)]


def add_launch_arguments(parser: argparse.ArgumentParser) -> None:
    """The options every command that starts ranks shares: --world-size, --device, --timeout."""
    parser.add_argument("--world-size", type=int, default=2, help="ranks to spawn (under torchrun: its world size)")
    parser.add_argument("--device", choices=DEVICES, default="auto",
                        help="auto: one GPU per rank with NCCL when there are enough GPUs, else CPU with gloo")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds before a stuck job is stopped")


def launch_world_size(parser: argparse.ArgumentParser, args: argparse.Namespace, argv: list[str]) -> int:
    """The job's world size: torchrun's when it started this process (a different --world-size is an error)."""
    if not under_torchrun():
        if args.world_size < 1:
            parser.error(f"--world-size must be at least 1, got {args.world_size}")
        return args.world_size
    started = int(os.environ["WORLD_SIZE"])
    if "--world-size" in argv and args.world_size != started:
        parser.error(f"--world-size {args.world_size} but torchrun started {started} ranks")
    return started
