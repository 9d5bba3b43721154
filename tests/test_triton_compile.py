"""The flash kernel built for A100 and H100 on a machine without a GPU.

Under the interpreter (tests/test_triton_interpret.py) the kernel's arithmetic is checked,
but nothing is compiled: a kernel can be right there and still fail to build for a GPU, or
build with tiles that overflow shared memory or spill registers. Here every tile the
autotuner may try is compiled for sm_80 and sm_90 in every GPU dtype, and the autotuner's
pruning hook is checked to hand each launch exactly its dtype's candidates.
"""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from mha_lab.cuda import compiled, flash
from mha_lab.cuda.tiles import INTERPRET

pytestmark = pytest.mark.skipif(INTERPRET, reason="TRITON_INTERPRET=1 is set: nothing is compiled for a GPU")

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
CASES = list(itertools.product(DTYPES, (64, 128), (False, True)))


class Builds:
    """Every tile candidate built for one GPU (``ARCH``): a class per GPU, which pytest-xdist runs whole in one
    worker (``--dist loadscope``), so that the two GPUs' builds (a minute or more each) run side by side."""

    ARCH = 0

    @pytest.mark.slow
    @pytest.mark.parametrize(("dtype", "head_dim", "causal"), CASES,
                             ids=[f"{str(dt)[6:]}-D{d}-{'causal' if c else 'full'}" for dt, d, c in CASES])
    def test_every_tile_candidate_builds_within_shared_memory_and_without_spills(self, dtype, head_dim, causal):
        builds = compiled.build_tile_candidates(self.ARCH, dtype, head_dim, causal)
        assert [b.tile for b in builds] == flash.tile_candidates(dtype, head_dim)
        for b in builds:
            assert 0 < b.shared_bytes <= compiled.SHARED_MEMORY_BYTES[self.ARCH], b
            assert 0 < b.registers <= 255, b
            assert b.spill_bytes == 0, b
            assert b.fits
            assert b.tensor_cores == (dtype != torch.float32), b


class TestSm80(Builds):
    ARCH = 80


class TestSm90(Builds):
    ARCH = 90


def test_every_architecture_has_its_class():
    assert sorted(c.ARCH for c in Builds.__subclasses__()) == sorted(compiled.ARCHITECTURES)


@pytest.mark.parametrize("arch", compiled.ARCHITECTURES)
def test_warps_split_the_query_rows_as_in_flashattention_2(arch):
    """Each warp owns BLOCK_M / num_warps whole rows of the tile: no warp shares a row's m, l or acc."""
    tile = flash.tile_candidates(torch.float16, 128)[0]
    assert compiled.build_flash_kernel(arch, torch.float16, 128, False, tile).warps_per_cta == (tile[2], 1)
    assert compiled.build_flash_kernel(arch, torch.float32, 64, False, (32, 32, 4, 2)).warps_per_cta is None


@pytest.mark.parametrize(("arch", "dtype", "head_dim", "block_d"), [
    (90, torch.bfloat16, 80, 128), (80, torch.float32, 40, 64), (90, torch.float16, 16, 16),
])
def test_head_sizes_that_are_not_a_power_of_two_or_are_small_build(arch, dtype, head_dim, block_d):
    build = compiled.build_flash_kernel(arch, dtype, head_dim, True, flash.tile_candidates(dtype, head_dim)[0])
    assert build.fits and build.tensor_cores == (dtype != torch.float32), build


@pytest.mark.parametrize("kernel", ["dkdv", "dq"])
def test_backward_kernels_build_for_an_h100_with_tensor_cores_and_without_spills(kernel):
    """The widest case, 16-bit at D = 128 and causal, with the first tile the autotuner tries."""
    from mha_lab.cuda.flash_backward import backward_tile_candidates

    tile = backward_tile_candidates(kernel, torch.bfloat16, 128)[0]
    build = compiled.build_flash_kernel(90, torch.bfloat16, 128, True, tile, kernel)
    assert build.kernel == kernel and build.tile == tile
    assert build.fits and build.tensor_cores and build.warps_per_cta[0] * build.warps_per_cta[1] == tile[2], build


def test_an_oversized_tile_is_reported_as_spilling():
    # 128 query rows x 128 head dims of fp32 accumulator over 4 warps is 128 registers a thread
    # for the accumulator alone: the compiler must spill, and the report must say so
    build = compiled.build_flash_kernel(90, torch.float16, 128, False, (128, 64, 4, 3))
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
        compiled.build_flash_kernel(arch, dtype, head_dim, False, tile, kernel)


def test_command_line_prints_a_table_and_rejects_bad_tiles(capsys):
    assert compiled.main(["--arch", "90", "--head-dim", "128", "--tile", "128,64,4,3", "--tile", "128,64,8,3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("| GPU | dtype | D |") and len(lines) == 4
    assert lines[2].endswith("| NO |") and lines[3].endswith("| yes |")  # the 4-warp tile spills, the 8-warp one fits
    argv = ["--arch", "80", "--dtype", "float32", "--head-dim", "40", "--tile", "32,32,4,2", "--json"]
    assert compiled.main(argv) == 0
    (build,) = json.loads(capsys.readouterr().out)
    assert build["dtype"] == "float32" and build["head_dim"] == 40 and build["tile"] == [32, 32, 4, 2]
    assert build["spill_bytes"] == 0 and build["tensor_cores"] is False
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
