"""The flash kernel built for A100 and H100 on a machine without a GPU.

Under the interpreter (tests/test_triton_interpret.py) the kernel's arithmetic is checked,
but nothing is compiled: a kernel can be right there and still fail to build for a GPU, or
build with tiles that overflow shared memory or spill registers. A build costs one to three
seconds of CPU, so each distinct one is made once, and the grid is cut where one build
stands for another:

* fp16 and bf16 share their tile lists and the kernel's code, and differ only in the
  operand type of the same tensor-core instructions: each architecture builds one of them
  (the A100 bf16, the H100 fp16), and the backward and a padded head size add bf16 on the H100.
* The causal kernel holds the non-causal one: the same unmasked loop, and a masked loop
  that adds the causal test to the ragged-block test. The A100 builds the causal kernel and
  the H100 the non-causal one, so each specialisation is compiled on some GPU.
* The A100 (sm_80) carries the sweep: every tile the autotuner may try, in both widths and
  both head-size classes (D = 64 and 128). It has the smaller shared memory (163 KiB a
  block) and no GPU run behind it. The H100 (sm_90) builds the first candidate of each list:
  on an H200 the autotuner timed every candidate, and each 16-bit one won at some length
  (book/data/gpu_bench.json). Register counts do differ between the two GPUs, so the
  sweep's "no spills" is a claim about the A100; on the H100 it holds for the tiles built here.
* Head sizes that are not a power of two (D = 40, 80) or the smallest (D = 16), the
  backward's two gradient kernels, and one tile that must spill are built once each.

Every test that needs a build asks this module's cache for it, so the warp layout, the
command line and the spill report reuse the builds above. The autotuner's pruning hook,
which compiles nothing, is checked for every dtype.
"""

from __future__ import annotations

import functools
import json

import pytest
import torch

from mha_lab.cuda import compiled, flash
from mha_lab.cuda.flash_backward import backward_tile_candidates
from mha_lab.cuda.tiles import INTERPRET

pytestmark = pytest.mark.skipif(INTERPRET, reason="TRITON_INTERPRET=1 is set: nothing is compiled for a GPU")

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# (architecture, its 16-bit dtype, causal): the A100 builds every candidate, the H100 the first of each list
SWEEP = (80, torch.bfloat16, True)
FIRSTS = (90, torch.float16, False)
LISTS = [(width, head_dim) for width in ("16-bit", "fp32") for head_dim in (64, 128)]  # one tile list each
_compile = compiled.build_flash_kernel


@functools.cache
def _cached_build(arch, dtype, head_dim, causal, tile, kernel):
    return _compile(arch, dtype, head_dim, causal, tile, kernel)


def _build(arch: int, dtype: torch.dtype, head_dim: int, causal: bool, tile: tuple[int, int, int, int],
           kernel: str = "forward") -> compiled.KernelBuild:
    """``compiled.build_flash_kernel``, compiled once per test process for each distinct request."""
    return _cached_build(arch, dtype, head_dim, bool(causal), tuple(tile), kernel)


@pytest.fixture(autouse=True)
def _builds_are_shared(monkeypatch):
    """The module's own calls (``build_tile_candidates``, the command line) go through the cache too."""
    monkeypatch.setattr(compiled, "build_flash_kernel", _build)


def _dtype(width: str, sixteen_bit: torch.dtype) -> torch.dtype:
    return sixteen_bit if width == "16-bit" else torch.float32


def _check_usable(build: compiled.KernelBuild) -> None:
    assert 0 < build.shared_bytes <= compiled.SHARED_MEMORY_BYTES[build.arch], build
    assert 0 < build.registers <= 255, build
    assert build.spill_bytes == 0, build
    assert build.fits
    assert build.tensor_cores == (build.dtype != torch.float32), build


@pytest.mark.slow
@pytest.mark.parametrize(("width", "head_dim"), LISTS, ids=[f"{w}-D{d}" for w, d in LISTS])
def test_every_tile_candidate_builds_for_an_a100_within_shared_memory_and_without_spills(width, head_dim):
    arch, sixteen_bit, causal = SWEEP
    dtype = _dtype(width, sixteen_bit)
    builds = compiled.build_tile_candidates(arch, dtype, head_dim, causal)
    assert [b.tile for b in builds] == flash.tile_candidates(dtype, head_dim)
    for b in builds:
        _check_usable(b)


@pytest.mark.slow
@pytest.mark.parametrize(("width", "head_dim"), LISTS, ids=[f"{w}-D{d}" for w, d in LISTS])
def test_first_tile_candidate_builds_for_an_h100_within_shared_memory_and_without_spills(width, head_dim):
    arch, sixteen_bit, causal = FIRSTS
    dtype = _dtype(width, sixteen_bit)
    build = _build(arch, dtype, head_dim, causal, flash.tile_candidates(dtype, head_dim)[0])
    assert (build.arch, build.causal) == (arch, causal)
    _check_usable(build)


def test_the_two_gpus_share_the_work():
    """One GPU builds the causal kernel and the other the non-causal one, in different 16-bit dtypes."""
    assert {SWEEP[0], FIRSTS[0]} == set(compiled.ARCHITECTURES)
    assert {SWEEP[1], FIRSTS[1]} == {torch.float16, torch.bfloat16} and SWEEP[2] != FIRSTS[2]


@pytest.mark.parametrize(("arch", "sixteen_bit", "causal"), [SWEEP, FIRSTS], ids=["sm80", "sm90"])
def test_warps_split_the_query_rows_as_in_flashattention_2(arch, sixteen_bit, causal):
    """Each warp owns BLOCK_M / num_warps whole rows of the tile: no warp shares a row's m, l or acc."""
    tile = flash.tile_candidates(sixteen_bit, 128)[0]
    assert _build(arch, sixteen_bit, 128, causal, tile).warps_per_cta == (tile[2], 1)
    fp32_tile = flash.tile_candidates(torch.float32, 64)[0]
    assert _build(arch, torch.float32, 64, causal, fp32_tile).warps_per_cta is None  # no tensor cores, no layout


@pytest.mark.parametrize(("arch", "dtype", "head_dim"), [
    (90, torch.bfloat16, 80), (80, torch.float32, 40), (90, torch.float16, 16),
])
def test_head_sizes_that_are_not_a_power_of_two_or_are_small_build(arch, dtype, head_dim):
    build = _build(arch, dtype, head_dim, True, flash.tile_candidates(dtype, head_dim)[0])
    assert build.fits and build.tensor_cores == (dtype != torch.float32), build


@pytest.mark.parametrize("kernel", ["dkdv", "dq"])
def test_backward_kernels_build_for_an_h100_with_tensor_cores_and_without_spills(kernel):
    """The widest case, 16-bit at D = 128 and causal, with the first tile the autotuner tries."""
    tile = backward_tile_candidates(kernel, torch.bfloat16, 128)[0]
    build = _build(90, torch.bfloat16, 128, True, tile, kernel)
    assert build.kernel == kernel and build.tile == tile
    assert build.fits and build.tensor_cores and build.warps_per_cta[0] * build.warps_per_cta[1] == tile[2], build


def test_an_oversized_tile_is_reported_as_spilling():
    # 128 query rows x 128 head dims of fp32 accumulator over 4 warps is 128 registers a thread
    # for the accumulator alone: the compiler must spill, and the report must say so
    build = _build(90, torch.float16, 128, False, (128, 64, 4, 3))
    assert build.spill_bytes > 0 and build.registers == 255 and not build.fits


@pytest.mark.parametrize(("arch", "dtype", "head_dim", "tile", "match", "kernel"), [
    (75, torch.float16, 64, (64, 64, 4, 3), "arch must be one of", "forward"),
    (90, torch.float64, 64, (64, 64, 4, 3), "dtype must be one of", "forward"),
    (90, torch.float16, 256, (64, 64, 4, 3), "head size D=256 is not supported", "forward"),
    (90, torch.float16, 64, (64, 64, 4), "tile is", "forward"),
    (90, torch.float16, 64, (64, 128, 4, 3), "BLOCK_N dividing BLOCK_M", "forward"),
    (90, torch.float16, 64, (48, 16, 4, 3), "powers of two", "forward"),
    (90, torch.float16, 64, (64, 64, 3, 3), "num_warps", "forward"),
    (90, torch.float16, 64, (64, 32, 4, 3), "BLOCK_M dividing BLOCK_N", "dkdv"),
    (90, torch.float16, 64, (64, 64, 4, 3), "kernel must be one of", "backward"),
])
def test_bad_build_requests_are_rejected(arch, dtype, head_dim, tile, match, kernel):
    with pytest.raises((ValueError, TypeError), match=match):
        _compile(arch, dtype, head_dim, False, tile, kernel)


def test_command_line_prints_a_table_and_rejects_bad_tiles(capsys):
    # the same builds as the spill report and the H100's first 16-bit tile at D = 128
    assert compiled.main(["--arch", "90", "--head-dim", "128", "--tile", "128,64,4,3", "--tile", "128,64,8,3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("| GPU | dtype | D |") and len(lines) == 4
    assert lines[2].endswith("| NO |") and lines[3].endswith("| yes |")  # the 4-warp tile spills, the 8-warp one fits
    tile = flash.tile_candidates(torch.float32, 40)[0]  # the padded fp32 head size's build
    argv = ["--arch", "80", "--dtype", "float32", "--head-dim", "40", "--causal", "--tile", ",".join(map(str, tile)),
            "--json"]
    assert compiled.main(argv) == 0
    (build,) = json.loads(capsys.readouterr().out)
    assert build["dtype"] == "float32" and build["head_dim"] == 40 and build["tile"] == list(tile)
    assert build["causal"] is True and build["spill_bytes"] == 0 and build["tensor_cores"] is False
    assert compiled.main(["--tile", "128,256,4,3"]) == 2
    assert "BLOCK_N dividing BLOCK_M" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        compiled.main(["--tile", "a,b"])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [16, 64, 80, 128])
def test_autotuner_pruning_keeps_exactly_the_dtypes_candidates(dtype, head_dim):
    block_d = max(16, 1 << (head_dim - 1).bit_length())
    q = torch.empty(1, 1, 1, head_dim, dtype=dtype)
    kept = flash._prune_tiles(flash._CONFIGS, {"Q": q}, BLOCK_D=block_d, HEAD_DIM=head_dim)
    as_tuples = [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) for c in kept]
    assert sorted(as_tuples) == sorted(flash.tile_candidates(dtype, head_dim))
    assert all(m % n == 0 for m, n, _, _ in as_tuples)  # the kernel's static_assert
