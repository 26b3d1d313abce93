"""The fused MoE kernels (``kernels/triton/fused_moe.py``) against their twin,
``torch_moe_reference``: in Triton's interpreter on a CPU (float32 and fp16, whose ``tl.dot``
the interpreter computes right), compiled where a GPU is (bf16 too, and a CUDA graph).

The twin rounds where the kernels do, so fp16 runs differ only where a GEMM's sum order or
``exp``'s last bit tips a rounding (an fp16 ulp, 2^-11 relative, carried through the down
projection); float32 runs only by sum order.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels.triton.fused_moe import (
    MOE_TILE_TIERS,
    MoETiles,
    TritonFusedMoE,
    fused_moe,
    moe_align,
    moe_tiles,
    padded_rows,
    torch_moe_reference,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
TOLERANCE = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.float16: {"atol": 4e-3, "rtol": 4e-3},
    torch.bfloat16: {"atol": 3e-2, "rtol": 3e-2},
}
BF16 = pytest.param(
    torch.bfloat16,
    marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(INTERPRETED, reason="interpreter tl.dot is wrong on bf16"),
    ],
)
DTYPES = [torch.float32, torch.float16, BF16]


def dtype_id(value: object) -> str | None:
    return str(value).removeprefix("torch.") if isinstance(value, torch.dtype) else None


def experts(num_experts: int, size: int, inter: int, dtype: torch.dtype, seed: int = 0):
    """``(w13, w2)`` at a scale that keeps the outputs near 1."""
    generator = torch.Generator().manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * inter, size, generator=generator) * size**-0.5
    w2 = torch.randn(num_experts, size, inter, generator=generator) * inter**-0.5
    return w13.to(DEVICE, dtype), w2.to(DEVICE, dtype)


def routing(num_tokens: int, top_k: int, num_experts: int, seed: int = 0):
    """``(topk_ids, topk_weights)``: k distinct experts per token, weights summing to 1."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.rand(num_tokens, num_experts, generator=generator).topk(top_k).indices
    weights = torch.rand(num_tokens, top_k, generator=generator).softmax(-1)
    return ids.to(DEVICE), weights.to(DEVICE)


def hidden_states(num_tokens: int, size: int, dtype: torch.dtype, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(num_tokens, size, generator=generator).to(DEVICE, dtype)


def assert_matches_twin(hidden, w13, w2, ids, weights, expert_offset=0, tiles=None):
    got = fused_moe(hidden, w13, w2, ids, weights, expert_offset, tiles)
    expected = torch_moe_reference(hidden, w13, w2, ids, weights, expert_offset)
    assert got.dtype == hidden.dtype and got.shape == hidden.shape
    torch.testing.assert_close(got.float(), expected.float(), **TOLERANCE[hidden.dtype])
    return got


# (experts, k, tokens, H, I): H and I past one column tile and off the block sizes (48), one
# token, and 33 tokens whose 66 pairs fill an expert past one 16-row block.
SHAPES = [(4, 1, 1, 32, 32), (8, 2, 5, 64, 48), (8, 2, 33, 48, 64), (4, 2, 33, 64, 32)]


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize(("num_experts", "top_k", "num_tokens", "size", "inter"), SHAPES)
def test_fused_moe_equals_its_twin(num_experts, top_k, num_tokens, size, inter, dtype):
    w13, w2 = experts(num_experts, size, inter, dtype)
    ids, weights = routing(num_tokens, top_k, num_experts)
    assert_matches_twin(hidden_states(num_tokens, size, dtype), w13, w2, ids, weights)


@pytest.mark.parametrize("tiles", [tiles for _, tiles in MOE_TILE_TIERS], ids=str)
def test_every_tile_tier_is_exact(tiles):
    w13, w2 = experts(4, 48, 80, torch.float32)
    ids, weights = routing(33, 2, 4)
    assert_matches_twin(hidden_states(33, 48, torch.float32), w13, w2, ids, weights, tiles=tiles)


def test_tiles_follow_rows_per_expert():
    assert moe_tiles(1 * 8, 128).block_m == 16  # Qwen3-30B-A3B decoding one token
    assert moe_tiles(2048 * 8, 128).block_m == 128  # ... a prefill chunk of 2048
    assert moe_tiles(32 * 2, 8).block_m == 16  # Mixtral at 32 tokens: 8 rows an expert
    assert moe_tiles(256 * 2, 8).block_m == 64
    assert moe_tiles(2048 * 2, 8).block_m == 128
    for _, tiles in MOE_TILE_TIERS:
        assert tiles.block_m >= 16  # tl.dot's least
    # One step depth per dtype at every tier, so a row's sums keep their order across tiers.
    assert {moe_tiles(n, 8).block_k for n in (1, 200, 5000)} == {64}
    assert moe_tiles(5000, 8, element_bytes=4).block_k == 32


def expected_alignment(ids: torch.Tensor, num_experts: int, block_m: int, expert_offset: int):
    """``moe_align``'s spec in Python: each local expert's pairs in flat order, its run padded to
    whole blocks with the pair count, the runs in expert order, then padding to the bound."""
    flat = ids.reshape(-1).tolist()
    num_pairs = len(flat)
    rows: list[int] = []
    blocks: list[int] = []
    for expert in range(num_experts):
        run = [i for i, e in enumerate(flat) if e == expert_offset + expert]
        if not run:
            continue
        run += [num_pairs] * (-len(run) % block_m)
        rows += run
        blocks += [expert] * (len(run) // block_m)
    in_use = len(rows)
    bound = padded_rows(num_pairs, num_experts, block_m)
    rows += [num_pairs] * (bound - in_use)
    blocks += [num_experts] * (bound // block_m - len(blocks))
    return rows, blocks, in_use


# (tokens, k, local experts, block_m, expert_offset, global experts)
ALIGN_CASES = [
    (1, 1, 4, 16, 0, 4),
    (5, 2, 8, 16, 0, 8),
    (33, 2, 4, 16, 0, 4),
    (33, 2, 8, 64, 0, 8),
    (40, 8, 16, 16, 0, 64),  # most experts empty, pairs of experts past the local ones
    (33, 2, 4, 16, 4, 8),  # the second rank's half
    (7, 3, 2, 16, 3, 8),  # experts on both sides of the rank's
]


@pytest.mark.parametrize(("num_tokens", "top_k", "num_experts", "block_m", "offset", "total"),
                         ALIGN_CASES)  # fmt: skip
def test_moe_align_sorts_each_pair_once_into_one_expert_blocks(
    num_tokens, top_k, num_experts, block_m, offset, total
):
    ids, _ = routing(num_tokens, top_k, total, seed=num_tokens)
    sorted_ids, expert_of_block, in_use = moe_align(ids, num_experts, block_m, offset)
    rows, blocks, rows_in_use = expected_alignment(ids.cpu(), num_experts, block_m, offset)
    assert sorted_ids.dtype == expert_of_block.dtype == in_use.dtype == torch.int32
    assert sorted_ids.tolist() == rows
    assert expert_of_block.tolist() == blocks
    assert in_use.tolist() == [rows_in_use]
    # The spec's consequences, said directly: each local pair once, padding the pair count.
    flat = ids.reshape(-1).cpu()
    local = ((flat >= offset) & (flat < offset + num_experts)).nonzero().flatten()
    real = sorted_ids[sorted_ids < flat.numel()].cpu()
    assert sorted(real.tolist()) == local.tolist()
    assert set(sorted_ids[sorted_ids >= flat.numel()].tolist()) <= {flat.numel()}
    for block, expert in enumerate(expert_of_block.tolist()):
        members = sorted_ids[block * block_m : (block + 1) * block_m].cpu()
        members = members[members < flat.numel()]
        assert (flat[members] == offset + expert).all()


def test_moe_align_sizes_come_from_shapes_alone():
    """The same shapes give the same sizes whatever the routing: a CUDA graph can replay it."""
    sizes = set()
    for seed in range(4):
        ids, _ = routing(9, 2, 8, seed=seed)
        sorted_ids, expert_of_block, _ = moe_align(ids, 8, 16)
        sizes.add((sorted_ids.shape, expert_of_block.shape))
    all_to_one = torch.zeros(9, 2, dtype=torch.int64, device=DEVICE)
    sorted_ids, expert_of_block, _ = moe_align(all_to_one, 8, 16)
    sizes.add((sorted_ids.shape, expert_of_block.shape))
    assert len(sizes) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=dtype_id)
def test_all_tokens_to_one_expert_and_experts_without_tokens(dtype):
    w13, w2 = experts(8, 32, 48, dtype)
    hidden = hidden_states(33, 32, dtype)
    _, weights = routing(33, 2, 8)
    one_expert = torch.full((33, 1), 3, device=DEVICE)
    assert_matches_twin(hidden, w13, w2, one_expert, weights[:, :1])  # a strided view
    two_experts = torch.tensor([[5, 2]] * 33, device=DEVICE)  # 66 pairs: past 4 blocks of 16
    assert_matches_twin(hidden, w13, w2, two_experts, weights)


def test_expert_parallel_ranks_add_up_to_all_experts():
    w13, w2 = experts(8, 32, 32, torch.float32)
    hidden = hidden_states(33, 32, torch.float32)
    ids, weights = routing(33, 2, 8)
    whole = fused_moe(hidden, w13, w2, ids, weights)
    first = assert_matches_twin(hidden, w13[:4], w2[:4], ids, weights, expert_offset=0)
    second = assert_matches_twin(hidden, w13[4:], w2[4:], ids, weights, expert_offset=4)
    torch.testing.assert_close(first + second, whole, **TOLERANCE[torch.float32])


def test_a_rank_whose_experts_get_no_pairs_gives_zeros():
    w13, w2 = experts(4, 32, 32, torch.float16)
    ids, weights = routing(5, 2, 4)
    out = fused_moe(hidden_states(5, 32, torch.float16), w13, w2, ids, weights, expert_offset=4)
    assert torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=dtype_id)
@pytest.mark.parametrize("num_experts", [4, 8])
def test_a_tokens_output_does_not_depend_on_its_batch(dtype, num_experts):
    """A token's output has the same bits alone as in a batch of 33, and wherever it sits in
    the batch (the tiles fixed: ``fused_moe`` would pick other ones for one token)."""
    w13, w2 = experts(num_experts, 48, 64, dtype)
    hidden = hidden_states(33, 48, dtype)
    ids, weights = routing(33, 2, num_experts)
    tiles = moe_tiles(33 * 2, num_experts, hidden.element_size())
    batch = fused_moe(hidden, w13, w2, ids, weights, tiles=tiles)
    for token in (0, 17, 32):
        one = slice(token, token + 1)
        alone = fused_moe(hidden[one], w13, w2, ids[one], weights[one], tiles=tiles)
        assert torch.equal(alone, batch[one]), token
    backwards = torch.arange(32, -1, -1, device=DEVICE)
    reversed_batch = fused_moe(
        hidden[backwards], w13, w2, ids[backwards], weights[backwards], tiles=tiles
    )
    assert torch.equal(reversed_batch, batch[backwards])


def test_the_module_holds_its_experts():
    w13, w2 = experts(8, 32, 32, torch.float32)
    hidden = hidden_states(5, 32, torch.float32)
    ids, weights = routing(5, 2, 8)
    module = TritonFusedMoE(w13[4:], w2[4:], expert_offset=4)
    assert module.num_experts == 4
    expected = fused_moe(hidden, w13[4:], w2[4:], ids, weights, expert_offset=4)
    assert torch.equal(module(hidden, ids, weights), expected)


def test_empty_batch():
    w13, w2 = experts(4, 32, 32, torch.float32)
    ids, weights = routing(0, 2, 4)
    out = fused_moe(hidden_states(0, 32, torch.float32), w13, w2, ids, weights)
    assert out.shape == (0, 32)


def test_operands_that_do_not_fit_are_refused():
    w13, w2 = experts(4, 32, 32, torch.float32)
    hidden = hidden_states(3, 32, torch.float32)
    ids, weights = routing(3, 2, 4)
    with pytest.raises(ValueError, match="one dtype"):
        fused_moe(hidden.half(), w13, w2, ids, weights)
    with pytest.raises(ValueError, match="do not match"):
        fused_moe(hidden, w13, w2[:, :, :16], ids, weights)
    with pytest.raises(ValueError, match="topk_ids"):
        fused_moe(hidden, w13, w2, ids[:2], weights)
    with pytest.raises(ValueError, match="topk_weights"):
        fused_moe(hidden, w13, w2, ids, weights[:, :1])
    with pytest.raises(ValueError, match="int32 or int64"):
        fused_moe(hidden, w13, w2, ids.float(), weights)


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRETED, reason="CUDA graphs need the compiled kernels")
def test_fused_moe_runs_inside_a_cuda_graph_without_syncing():
    """No step reads back to the host (sync debug mode raises if one does), and a captured call
    replays other routings of the same shapes right."""
    dtype = torch.bfloat16
    w13, w2 = experts(8, 256, 128, dtype)
    hidden = hidden_states(16, 256, dtype)
    ids, weights = routing(16, 2, 8)
    tiles = moe_tiles(32, 8, hidden.element_size())
    fused_moe(hidden, w13, w2, ids, weights, tiles=tiles)  # compiles outside the capture
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fused_moe(hidden, w13, w2, ids, weights, tiles=tiles)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(hidden, w13, w2, ids, weights, tiles=tiles)
    for seed in (1, 2):
        new_ids, new_weights = routing(16, 2, 8, seed=seed)
        ids.copy_(new_ids)
        weights.copy_(new_weights)
        graph.replay()
        expected = torch_moe_reference(hidden, w13, w2, ids, weights)
        torch.testing.assert_close(out.float(), expected.float(), **TOLERANCE[dtype])


# Compiles both kernels at every tile tier for an H100/H200 (sm_90) in bf16, in a process of its
# own (Triton chooses between the interpreter and the compiler when the kernels are decorated),
# and prints each one's registers line and shared memory. Every pointer and integer but the pair
# count and k is taken as 16-divisible, as the JIT specialises them in a model's launches (a
# model's sizes are multiples of 16): without that no load is asynchronous, and the 64-row
# gate/up kernel spills.
_COMPILE_SCRIPT = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from benchmarks.step.compiled_kernels import _disassemble
from kernels.triton.fused_moe import MOE_TILE_TIERS, _down_kernel, _gate_up_kernel

INDEXES = ("sorted_ids_ptr", "expert_of_block_ptr", "rows_in_use_ptr")
for _, tiles in MOE_TILE_TIERS:
    for fn in (_gate_up_kernel, _down_kernel):
        constexprs = {"BLOCK_M": tiles.block_m, "BLOCK_N": tiles.block_n, "BLOCK_K": tiles.block_k}
        signature, attrs = {}, {}
        for index, name in enumerate(fn.arg_names):
            if name in constexprs:
                signature[name] = "constexpr"
                continue
            if name.endswith("_ptr"):
                kind = "i32" if name in INDEXES else "fp32" if name == "routing_ptr" else "bf16"
                signature[name] = "*" + kind
            else:
                signature[name] = "i32"
            if name not in ("num_pairs", "top_k"):
                attrs[(index,)] = [["tt.divisibility", 16]]
        kernel = triton.compile(
            ASTSource(fn, signature, constexprs, attrs),
            target=GPUTarget("cuda", 90, 32),
            options={"num_warps": tiles.num_warps, "num_stages": tiles.num_stages},
        )
        _, resources = _disassemble(kernel.asm["cubin"])
        print(fn.__name__, tiles, resources.split(" SHARED")[0], kernel.metadata.shared, sep="|")
"""


@pytest.mark.slow
def test_every_tile_tier_compiles_for_a_gpu_within_its_limits():
    """Checked without a GPU: each tier's kernels compile for sm_90, keep their registers (no
    stack, which is spills), and take at most 99 KiB of shared memory, what an sm_89 GPU gives
    a program (a tier past it would not launch there)."""
    nvidia = pytest.importorskip("triton.backends.nvidia")
    if not (Path(nvidia.__file__).parent / "bin" / "cuobjdump").exists():
        pytest.skip("this Triton has no NVIDIA toolchain to compile with")
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-c", _COMPILE_SCRIPT],
        cwd=Path(__file__).parent.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line.split("|") for line in result.stdout.splitlines()]
    assert len(lines) == 2 * len(MOE_TILE_TIERS)
    for name, tiles, registers, shared in lines:
        assert "STACK:0" in registers, (name, tiles, registers)
        assert int(shared) <= 99 * 1024, (name, tiles, shared)


def test_tiles_print_and_refuse_sizes_tl_dot_cannot_take():
    assert str(MoETiles(16, 32, 64, 4, 4)) == "m16 n32 k64 w4 s4"
    with pytest.raises(ValueError, match="at least 16"):
        MoETiles(8, 32, 64, 4, 4)
    with pytest.raises(ValueError, match="powers of two"):
        MoETiles(16, 48, 64, 4, 4)
