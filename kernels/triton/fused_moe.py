"""A mixture-of-experts layer's experts on CUDA: two grouped GEMMs over the (token, slot) pairs
that the router sent to each expert, SiLU-and-multiply fused into the first.

``moe_align`` sorts the pairs by expert (torch ops on the device, no host synchronisation, so
the layer can be captured in a CUDA graph) and pads each expert's run of pairs to whole blocks of
``block_m`` rows: every block belongs to one expert. Then one program per (block, column tile):

- ``_gate_up_kernel`` gathers the block's token rows of ``hidden``, multiplies them by the
  expert's gate and up rows of ``w13`` together (one dot over a tile whose columns alternate gate
  and up) and writes ``silu(gate) * up`` to an intermediate row per sorted position;
- ``_down_kernel`` multiplies those rows by the expert's ``w2``, scales each by its pair's
  routing weight and writes it to the pair's own row of ``[N * k, H]``;

and torch sums each token's k rows, slot 0 first. Both kernels walk the sum from 0 in
``block_k`` steps in one program (no split-K), in float32.

Rounding, the same points as the twin ``torch_moe_reference`` (a chain of ``F.linear`` in the
hidden dtype), so the two differ only in the order of the GEMMs' sums and in ``exp``'s last bit:
gate and up are each rounded to the hidden dtype, then ``silu(gate)``, then ``silu(gate) * up``;
the down projection is rounded to the hidden dtype, multiplied by the float32 routing weight and
rounded again; a token's k rows are summed in float32, slot 0 + slot 1 + ..., and rounded once.

Batch invariance: a pair's row is computed from its own token's row alone, its sums in one
order set by ``block_k``, and a token's rows are summed in slot order; so with the tiles fixed,
a token's output has the same bits whatever else is in the batch. ``fused_moe`` picks tiles by
the batch's expected rows per expert (``moe_tiles``); every tier has the same ``block_k``, but a
GPU may multiply a 16-row tile with other instructions than a 64-row one, so a caller that needs
the same bits at every batch size passes one ``MoETiles`` for all of them.

Expert parallelism: ``topk_ids`` hold global expert ids, the weights only this rank's experts
``[expert_offset, expert_offset + E_local)``; pairs routed elsewhere contribute zero.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import nn

from kernels.sizes import ceil_div

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class MoETiles:
    block_m: int  # sorted rows per program: moe_align's block, all of one expert (>= 16: tl.dot)
    block_n: int  # output columns per program (the gate/up kernel: this many of gate and of up)
    block_k: int  # depth of each step along a sum
    num_warps: int
    num_stages: int

    def __post_init__(self) -> None:
        sizes = (self.block_m, self.block_n, self.block_k)
        if any(size < 16 or size & (size - 1) for size in sizes):
            raise ValueError(f"tile sizes are powers of two of at least 16 (tl.dot's), got {self}")

    def __str__(self) -> str:
        return (
            f"m{self.block_m} n{self.block_n} k{self.block_k} w{self.num_warps} s{self.num_stages}"
        )


# By rows per expert, the most each tier takes. Decode sends each expert a few rows, so the
# kernels stream weights: a 16-row tile (tl.dot's least) multiplies the fewest padding rows, and
# 32-column tiles spread the experts hit over more programs (Qwen3-30B-A3B at one token: 8
# experts x 768 / 32 = 192 programs for the gate/up GEMM on an H100's 132 SMs), with one more
# stage of weights in flight. Prefill chunks give an expert hundreds of rows: 128-row tiles use
# each weight tile loaded twice as often as 64-row ones, with 8 warps for the 128 x 128 float32
# gate/up accumulator. Every tier sums in steps of the same depth (``_by_bytes``).
# Not yet tuned on a GPU: ``python -m benchmarks.step.fused_moe`` times these.
MOE_TILE_TIERS: tuple[tuple[float, MoETiles], ...] = (
    (16, MoETiles(block_m=16, block_n=32, block_k=64, num_warps=4, num_stages=4)),
    (64, MoETiles(block_m=64, block_n=64, block_k=64, num_warps=4, num_stages=3)),
    (float("inf"), MoETiles(block_m=128, block_n=64, block_k=64, num_warps=8, num_stages=3)),
)


def _by_bytes(tiles: MoETiles, element_bytes: int) -> MoETiles:
    """Steps 128 bytes deep: 64 elements of a 16-bit dtype, 32 of float32, whose 128-row tiles
    would otherwise take 192 KiB of shared memory at 3 stages (an sm_89 GPU has 99 KiB)."""
    return replace(tiles, block_k=128 // element_bytes)


@functools.cache
def moe_tiles(num_pairs: int, num_experts: int, element_bytes: int = 2) -> MoETiles:
    """The tiles for ``num_pairs`` (token, slot) pairs over ``num_experts`` local experts, by the
    rows an expert gets when routing is even (the real counts are on the device)."""
    rows_per_expert = num_pairs / num_experts
    tiles = next(tiles for most, tiles in MOE_TILE_TIERS if rows_per_expert <= most)
    return _by_bytes(tiles, element_bytes)


def padded_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    """How many sorted rows ``moe_align`` makes room for: every pair, plus up to ``block_m - 1``
    padding rows for each expert that has any (at most ``min(num_experts, num_pairs)`` do),
    rounded up to whole blocks. A bound from the shapes alone, so it needs no data."""
    most = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return ceil_div(most, block_m) * block_m


def moe_align(
    topk_ids: torch.Tensor, num_experts: int, block_m: int, expert_offset: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The (token, slot) pairs of ``topk_ids [N, k]`` sorted into blocks of ``block_m`` rows,
    each block all of one local expert: ``(sorted_token_ids, expert_of_block,
    num_tokens_post_padded)``.

    - ``sorted_token_ids [padded_rows(N * k, num_experts, block_m)]`` int32: each pair's flat
      index ``token * k + slot``, once, ordered by local expert, then by flat index; each
      expert's run padded to a whole block with ``N * k``, which the kernels mask, as are the
      rows past the end. Pairs whose expert is not in ``[expert_offset, expert_offset +
      num_experts)`` are left out.
    - ``expert_of_block [padded_rows / block_m]`` int32: each block's local expert;
      ``num_experts`` for the blocks past the end, which the kernels skip.
    - ``num_tokens_post_padded [1]`` int32: the rows in use, a multiple of ``block_m``.

    Sizes come from the shapes alone and nothing is read back to the host, so a CUDA graph can
    hold it. The order depends on the routing alone (a stable sort)."""
    if num_experts < 1 or block_m < 1:
        raise ValueError(f"moe_align needs experts and blocks, got {num_experts}, {block_m}")
    num_pairs = topk_ids.numel()
    device = topk_ids.device
    local = topk_ids.reshape(-1).to(torch.int64) - expert_offset
    # Pairs of other ranks' experts go to one more bucket, after every local expert's.
    bucket = local.masked_fill((local < 0) | (local >= num_experts), num_experts)
    sorted_bucket, order = torch.sort(bucket, stable=True)
    # Where each bucket's run begins in the sorted pairs (the last: where the other ranks'
    # pairs begin), hence each expert's count and its run padded to whole blocks.
    first = torch.searchsorted(sorted_bucket, torch.arange(num_experts + 1, device=device))
    counts = first[1:] - first[:-1]
    padded_counts = (counts + block_m - 1) // block_m * block_m
    padded_ends = torch.cumsum(padded_counts, 0)
    padded_starts = padded_ends - padded_counts

    # Every row looks up its pair (gathers only: no two writes to one place).
    rows = padded_rows(num_pairs, num_experts, block_m)
    row = torch.arange(rows, device=device)
    expert_of_row = torch.searchsorted(padded_ends, row, right=True)  # num_experts past the end
    expert = expert_of_row.clamp(max=num_experts - 1)
    rank = row - padded_starts[expert]
    holds_pair = (expert_of_row < num_experts) & (rank < counts[expert])
    pair = order[(first[expert] + rank).clamp(max=num_pairs - 1)]  # in range, if not used
    sorted_token_ids = torch.where(holds_pair, pair, num_pairs).to(torch.int32)
    expert_of_block = expert_of_row[::block_m].to(torch.int32)
    num_tokens_post_padded = padded_ends[-1:].to(torch.int32)
    return sorted_token_ids, expert_of_block, num_tokens_post_padded


@triton.jit
def _block_of_one_expert(
    sorted_ids_ptr,  # [padded rows] int32
    expert_of_block_ptr,  # [padded rows / BLOCK_M] int32
    num_pairs,
    BLOCK_M: tl.constexpr,
):
    """This program's sorted rows (int64), the pair at each, which of them hold a pair (not
    padding), and the block's expert (int64)."""
    block = tl.program_id(0)
    rows = block.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_ids_ptr + rows)
    expert = tl.load(expert_of_block_ptr + block).to(tl.int64)
    return rows, pairs, pairs < num_pairs, expert


@triton.jit
def _rows_times_weight(
    a_rows,  # [BLOCK_M, 1] pointers to the rows of A, unit stride along K
    row_mask,  # [BLOCK_M]
    w_rows,  # [1, N_TILE] pointers to the weight rows, unit stride along K
    col_mask,  # [N_TILE]
    K,
    BLOCK_M: tl.constexpr,
    N_TILE: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """``A @ W^T`` over the tile, in float32, K walked from 0 in BLOCK_K steps: both kernels'
    one loop, so that they sum alike."""
    acc = tl.zeros([BLOCK_M, N_TILE], tl.float32)
    for start in range(0, K, BLOCK_K):
        offs_k = start + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        a = tl.load(a_rows + offs_k[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_rows + offs_k[:, None], mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        # "ieee": float32 operands summed as float32, never TF32.
        acc = tl.dot(a, w, acc, input_precision="ieee")
    return acc


@triton.jit(do_not_specialize=["num_pairs"])
def _gate_up_kernel(
    hidden_ptr,  # [N, H], unit stride along H
    w13_ptr,  # [E, 2I, H], unit stride along H: gate rows, then up rows
    out_ptr,  # [padded rows, I], contiguous: silu(gate) * up at each sorted row
    sorted_ids_ptr,  # [padded rows] int32: pair token * top_k + slot, num_pairs for padding
    expert_of_block_ptr,  # [padded rows / BLOCK_M] int32
    rows_in_use_ptr,  # [1] int32
    num_pairs,
    top_k,
    hidden_size,  # H
    inter_size,  # I, each expert's intermediate size
    stride_hidden,
    stride_w_expert,
    stride_w_row,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    if tl.program_id(0) * BLOCK_M >= tl.load(rows_in_use_ptr):
        return
    rows, pairs, row_mask, expert = _block_of_one_expert(
        sorted_ids_ptr, expert_of_block_ptr, num_pairs, BLOCK_M
    )
    tokens = (pairs // top_k).to(tl.int64)
    # The weight tile's columns alternate gate and up, column c of each at 2c and 2c + 1, so
    # one dot gives both and a split parts them.
    wide = tl.arange(0, 2 * BLOCK_N)
    cols_of_wide = tl.program_id(1) * BLOCK_N + wide // 2
    w_row = (wide % 2) * inter_size + cols_of_wide
    acc = _rows_times_weight(
        hidden_ptr + tokens[:, None] * stride_hidden,
        row_mask,
        w13_ptr + expert * stride_w_expert + w_row.to(tl.int64)[None, :] * stride_w_row,
        cols_of_wide < inter_size,
        hidden_size,
        BLOCK_M,
        2 * BLOCK_N,
        BLOCK_K,
    )
    gate, up = tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N, 2)))
    # As the twin rounds: gate and up (each an F.linear), silu(gate), then the product.
    dtype = out_ptr.dtype.element_ty
    gate = gate.to(dtype).to(tl.float32)
    up = up.to(dtype).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(
        out_ptr + rows[:, None] * inter_size + cols[None, :],
        (silu * up).to(dtype),
        mask=row_mask[:, None] & (cols < inter_size)[None, :],
    )


@triton.jit(do_not_specialize=["num_pairs"])
def _down_kernel(
    intermediate_ptr,  # [padded rows, I], contiguous: the gate/up kernel's output
    w2_ptr,  # [E, H, I], unit stride along I
    routing_ptr,  # [num_pairs] float32: each pair's routing weight
    out_ptr,  # [num_pairs, H], contiguous: each pair's weighted down projection
    sorted_ids_ptr,  # [padded rows] int32
    expert_of_block_ptr,  # [padded rows / BLOCK_M] int32
    rows_in_use_ptr,  # [1] int32
    num_pairs,
    hidden_size,  # H
    inter_size,  # I, each expert's intermediate size
    stride_w_expert,
    stride_w_row,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    if tl.program_id(0) * BLOCK_M >= tl.load(rows_in_use_ptr):
        return
    rows, pairs, row_mask, expert = _block_of_one_expert(
        sorted_ids_ptr, expert_of_block_ptr, num_pairs, BLOCK_M
    )
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < hidden_size
    acc = _rows_times_weight(
        intermediate_ptr + rows[:, None] * inter_size,
        row_mask,
        w2_ptr + expert * stride_w_expert + cols.to(tl.int64)[None, :] * stride_w_row,
        col_mask,
        inter_size,
        BLOCK_M,
        BLOCK_N,
        BLOCK_K,
    )
    # As the twin rounds: the down projection (an F.linear), then times the float32 weight.
    dtype = out_ptr.dtype.element_ty
    weight = tl.load(routing_ptr + pairs, mask=row_mask, other=0.0)
    down = (acc.to(dtype).to(tl.float32) * weight[:, None]).to(dtype)
    tl.store(
        out_ptr + pairs.to(tl.int64)[:, None] * hidden_size + cols[None, :],
        down,
        mask=row_mask[:, None] & col_mask[None, :],
    )


def _check_operands(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
) -> None:
    if hidden.dtype not in _DTYPES or w13.dtype != hidden.dtype or w2.dtype != hidden.dtype:
        raise ValueError(
            "fused_moe needs fp16/bf16/fp32 hidden states and weights of one dtype, got "
            f"{hidden.dtype}, {w13.dtype}, {w2.dtype}"
        )
    if hidden.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(
            f"fused_moe takes hidden [N, H], w13 [E, 2I, H] and w2 [E, H, I], got "
            f"{tuple(hidden.shape)}, {tuple(w13.shape)}, {tuple(w2.shape)}"
        )
    num_experts, two_inter, size = w13.shape
    if size != hidden.shape[1] or two_inter % 2 or w2.shape != (num_experts, size, two_inter // 2):
        raise ValueError(
            f"w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} do not match hidden "
            f"{tuple(hidden.shape)} as [E, 2I, H] and [E, H, I]"
        )
    if topk_ids.dim() != 2 or topk_ids.shape[0] != hidden.shape[0]:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} is not [N, k] for N = {len(hidden)}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if topk_weights.shape != topk_ids.shape or not topk_weights.is_floating_point():
        raise ValueError(
            f"topk_weights must be floats shaped as topk_ids {tuple(topk_ids.shape)}, got "
            f"{topk_weights.dtype} {tuple(topk_weights.shape)}"
        )
    devices = {t.device for t in (hidden, w13, w2, topk_ids, topk_weights)}
    if len(devices) != 1:
        raise ValueError(
            f"fused_moe's operands are on several devices: {sorted(map(str, devices))}"
        )


def _unit_stride_rows(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def fused_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    expert_offset: int = 0,
    tiles: MoETiles | None = None,
) -> torch.Tensor:
    """The experts' output ``[N, H]`` in ``hidden``'s dtype: for each token, the sum over its
    slots of ``topk_weights * down(silu(gate(x)) * up(x))`` by expert ``topk_ids``.

    ``hidden [N, H]``; ``w13 [E_local, 2I, H]`` (each expert's gate rows, then its up rows);
    ``w2 [E_local, H, I]``; ``topk_ids [N, k]`` global expert ids (int32/int64);
    ``topk_weights [N, k]`` the routing weights, taken as float32 (16-bit ones are widened,
    exactly). The weights hold experts ``[expert_offset, expert_offset + E_local)``; pairs of
    other experts contribute zero. ``tiles``: ``moe_tiles``' choice when None. Rounds as the
    module docstring says; nothing is read back to the host."""
    _check_operands(hidden, w13, w2, topk_ids, topk_weights)
    num_tokens, size = hidden.shape
    num_experts, two_inter, _ = w13.shape
    inter = two_inter // 2
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return torch.zeros_like(hidden)
    if tiles is None:
        tiles = moe_tiles(num_pairs, num_experts, hidden.element_size())
    hidden, w13, w2 = _unit_stride_rows(hidden), _unit_stride_rows(w13), _unit_stride_rows(w2)
    sorted_ids, expert_of_block, rows_in_use = moe_align(
        topk_ids, num_experts, tiles.block_m, expert_offset
    )
    rows = sorted_ids.numel()
    intermediate = torch.empty(rows, inter, dtype=hidden.dtype, device=hidden.device)
    # Zeros: the rows of pairs routed to other ranks' experts are never written.
    per_pair = torch.zeros(num_pairs, size, dtype=hidden.dtype, device=hidden.device)
    launch = {
        "BLOCK_M": tiles.block_m,
        "BLOCK_N": tiles.block_n,
        "BLOCK_K": tiles.block_k,
        "num_warps": tiles.num_warps,
        "num_stages": tiles.num_stages,
    }
    blocks = rows // tiles.block_m
    _gate_up_kernel[(blocks, ceil_div(inter, tiles.block_n))](
        hidden,
        w13,
        intermediate,
        sorted_ids,
        expert_of_block,
        rows_in_use,
        num_pairs,
        top_k,
        size,
        inter,
        hidden.stride(0),
        w13.stride(0),
        w13.stride(1),
        **launch,
    )
    _down_kernel[(blocks, ceil_div(size, tiles.block_n))](
        intermediate,
        w2,
        topk_weights.reshape(-1).to(torch.float32).contiguous(),
        per_pair,
        sorted_ids,
        expert_of_block,
        rows_in_use,
        num_pairs,
        size,
        inter,
        w2.stride(0),
        w2.stride(1),
        **launch,
    )
    return sum_slots_in_order(per_pair.view(num_tokens, top_k, size))


def sum_slots_in_order(per_slot: torch.Tensor) -> torch.Tensor:
    """``per_slot [N, k, H]`` summed over k in float32, slot 0 + slot 1 + ... (a fixed order,
    which a reduction kernel's need not be), rounded once to its dtype."""
    total = per_slot[:, 0].to(torch.float32)
    for slot in range(1, per_slot.shape[1]):
        total = total + per_slot[:, slot].to(torch.float32)
    return total.to(per_slot.dtype)


def torch_moe_reference(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    expert_offset: int = 0,
) -> torch.Tensor:
    """``fused_moe``'s twin and spec, in plain torch: for each local expert in ascending id, the
    rows routed to it gathered, ``F.linear`` by its gate and up rows, ``silu(gate) * up``,
    ``F.linear`` by its ``w2``, times the routing weight in float32 and rounded to the hidden
    dtype; then each token's k rows summed in slot order (``sum_slots_in_order``). Reads the
    routing back to the host: a reference, not a kernel."""
    _check_operands(hidden, w13, w2, topk_ids, topk_weights)
    num_tokens, top_k = topk_ids.shape
    inter = w2.shape[2]
    per_slot = torch.zeros(num_tokens, top_k, hidden.shape[1], dtype=hidden.dtype,
                           device=hidden.device)  # fmt: skip
    for local in range(w13.shape[0]):
        tokens, slots = torch.where(topk_ids == expert_offset + local)
        if tokens.numel() == 0:
            continue
        x = hidden[tokens]
        gate = F.linear(x, w13[local, :inter])
        up = F.linear(x, w13[local, inter:])
        down = F.linear(F.silu(gate) * up, w2[local])
        weight = topk_weights[tokens, slots].to(torch.float32)[:, None]
        per_slot[tokens, slots] = (down.to(torch.float32) * weight).to(hidden.dtype)
    return sum_slots_in_order(per_slot)


class TritonFusedMoE(nn.Module):
    """A mixture-of-experts layer's experts: holds the stacked weights, ``w13 [E_local, 2I, H]``
    (gate rows, then up rows) and ``w2 [E_local, H, I]``, of experts ``[expert_offset,
    expert_offset + E_local)``, and runs ``fused_moe`` over them; with ``tiles``, those at every
    batch size (batch-invariant), else the batch's tier."""

    def __init__(
        self,
        w13: torch.Tensor,
        w2: torch.Tensor,
        expert_offset: int = 0,
        tiles: MoETiles | None = None,
    ) -> None:
        super().__init__()
        self.w13 = w13.detach().contiguous()
        self.w2 = w2.detach().contiguous()
        self.expert_offset = expert_offset
        self.num_experts = w13.shape[0]
        self.tiles = tiles

    def forward(
        self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        return fused_moe(
            hidden, self.w13, self.w2, topk_ids, topk_weights, self.expert_offset, self.tiles
        )
