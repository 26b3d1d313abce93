"""CUDA only: the fused MoE kernels (``kernels/triton/fused_moe.py``) on two models' expert
shapes, beside a dense bf16 GEMM of the same FLOPs and beside their torch twin.

Shapes, bf16 with random weights and random routing (k distinct experts a token): Qwen3-30B-A3B's
(H 2048, I 768 an expert, 128 experts, top 8) and Mixtral-8x7B's (H 4096, I 14336, 8 experts,
top 2), at 1 to 2048 tokens. One line per case, its columns::

    model  tokens  hit  fused us  TFLOP/s  GB/s  dense us  TFLOP/s  torch us  vs torch
        max diff  tiles

- ``hit``: the experts the routing sent any token to; ``GB/s``: their weights' bytes (gate, up
  and down) over the fused time, what bounds it at few tokens;
- ``TFLOP/s``: the active FLOPs, ``2 * N * k * (2I * H + H * I)``, over the time;
- ``dense``: one ``torch.mm`` of ``[N * k, H] x [H, 3I]``, the same FLOPs on one weight
  (cuBLAS's rate at that shape, what the grouped GEMMs aim at when compute-bound);
- ``torch``: ``torch_moe_reference``, a loop over the experts that reads the routing back to the
  host; ``vs torch``: its time over the fused one's; ``max diff``: the largest difference
  between the two outputs (bf16: the kernels and the twin round alike, so a few of bf16's ulps).

Times are Triton's ``do_bench`` medians, the L2 cache flushed before each call.

    python -m benchmarks.step.fused_moe [--tokens 1,8,32,256,2048] [--models qwen3,mixtral]

Without CUDA it says so and exits 0.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton.testing

from kernels.triton.fused_moe import fused_moe, moe_tiles, torch_moe_reference


@dataclass(frozen=True, slots=True)
class MoEShape:
    name: str
    hidden_size: int  # H
    inter_size: int  # I, each expert's
    num_experts: int
    top_k: int


SHAPES = {
    "qwen3": MoEShape("qwen3-30b-a3b", 2048, 768, 128, 8),
    "mixtral": MoEShape("mixtral-8x7b", 4096, 14336, 8, 2),
}


def time_us(fn: Callable[[], object]) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3


def random_experts(shape: MoEShape) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w13, w2)`` in bf16 on the GPU, scaled to keep activations near 1."""
    e, h, i = shape.num_experts, shape.hidden_size, shape.inter_size
    w13 = torch.randn(e, 2 * i, h, device="cuda", dtype=torch.bfloat16).mul_(h**-0.5)
    w2 = torch.randn(e, h, i, device="cuda", dtype=torch.bfloat16).mul_(i**-0.5)
    return w13, w2


def random_routing(num_tokens: int, shape: MoEShape) -> tuple[torch.Tensor, torch.Tensor]:
    scores = torch.rand(num_tokens, shape.num_experts, device="cuda")
    ids = scores.topk(shape.top_k).indices
    weights = torch.rand(num_tokens, shape.top_k, device="cuda").softmax(-1)
    return ids, weights


def bench_case(
    shape: MoEShape, w13: torch.Tensor, w2: torch.Tensor, dense_weight: torch.Tensor, tokens: int
) -> str:
    """One line of the table: ``tokens`` tokens routed at random."""
    h, i, k = shape.hidden_size, shape.inter_size, shape.top_k
    hidden = torch.randn(tokens, h, device="cuda", dtype=torch.bfloat16)
    ids, weights = random_routing(tokens, shape)
    dense_input = torch.randn(tokens * k, h, device="cuda", dtype=torch.bfloat16)
    fused = time_us(lambda: fused_moe(hidden, w13, w2, ids, weights))
    dense = time_us(lambda: torch.mm(dense_input, dense_weight))
    twin = time_us(lambda: torch_moe_reference(hidden, w13, w2, ids, weights))
    got = fused_moe(hidden, w13, w2, ids, weights).float()
    diff = (got - torch_moe_reference(hidden, w13, w2, ids, weights).float()).abs().max().item()

    hit = ids.unique().numel()
    hit_bytes = hit * 3 * i * h * w13.element_size()
    flops = 2 * tokens * k * (2 * i * h + h * i)
    tiles = moe_tiles(tokens * k, shape.num_experts, hidden.element_size())
    return (
        f"{shape.name:<15s}{tokens:>7d}{hit:>5d}"
        f"{fused:>10.1f}{flops / fused / 1e6:>9.1f}{hit_bytes / fused / 1e3:>7.0f}"
        f"{dense:>10.1f}{flops / dense / 1e6:>9.1f}"
        f"{twin:>10.1f}{twin / fused:>9.1f}x{diff:>10.2g}  {tiles}"
    )


def bench_shape(shape: MoEShape, token_counts: list[int]) -> None:
    w13, w2 = random_experts(shape)
    dense_weight = torch.randn(shape.hidden_size, 3 * shape.inter_size, device="cuda",
                               dtype=torch.bfloat16)  # fmt: skip
    for tokens in token_counts:
        print(bench_case(shape, w13, w2, dense_weight, tokens), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1,8,32,256,2048")
    parser.add_argument("--models", default="qwen3,mixtral", help="of: " + ",".join(SHAPES))
    args = parser.parse_args(argv)
    names = args.models.split(",")
    unknown = [name for name in names if name not in SHAPES]
    if unknown:
        parser.error(f"unknown models {unknown}; choose from {sorted(SHAPES)}")
    if not torch.cuda.is_available():
        print("benchmarks.step.fused_moe measures the fused MoE kernels on a CUDA GPU; none is "
              "visible.")  # fmt: skip
        return 0
    torch.manual_seed(0)
    print(f"device: {torch.cuda.get_device_name()}")
    print(
        f"{'model':<15s}{'tokens':>7s}{'hit':>5s}{'fused us':>10s}{'TFLOP/s':>9s}{'GB/s':>7s}"
        f"{'dense us':>10s}{'TFLOP/s':>9s}{'torch us':>10s}{'vs torch':>10s}{'max diff':>10s}"
        "  tiles"
    )
    token_counts = [int(count) for count in args.tokens.split(",")]
    for name in names:
        bench_shape(SHAPES[name], token_counts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
