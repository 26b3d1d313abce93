"""CUDA only: the Triton GEMM over quantized codes against bf16's (cuBLAS), on Llama-3.1-8B's
linear shapes, at 1 to 4096 rows.

Per format and row count, one pass over one layer's four linears (fused q/k/v 6144 x 4096, o
4096 x 4096, gate_up 28672 x 4096, down 4096 x 14336): microseconds, the ratio to bf16's, and
the rate (GB/s of weights read at the small row counts, where a decode step is bound by them;
TFLOP/s at the large ones). The formats: FP8 e4m3 per channel, block FP8 (128 x 128 blocks),
int8 per channel, 4-bit in groups of 128 with offsets (W4A16 asymmetric)::

    format          rows        us   vs bf16     GB/s   TFLOP/s

    python -m benchmarks.step.quantized_triton [--rows 1,16,64,256,1024,4096] [--repeats 20]
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.quantized import FP8_E4M3, INT8, UINT4, QuantizedLinear, QuantizedWeight
from kernels.sizes import ceil_div
from kernels.triton.quantized_gemm import quantized_linear

# (out_features, in_features) of one Llama-3.1-8B layer's linears.
SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]


@dataclass(frozen=True, slots=True)
class Format:
    name: str
    kind: str
    group_size: int | None  # None: one group per row
    offsets: bool = False


FORMATS = [
    Format("fp8 channel", FP8_E4M3, None),
    Format("fp8 block128", FP8_E4M3, 128),
    Format("int8 channel", INT8, None),
    Format("w4a16 g128", UINT4, 128, offsets=True),
]


def random_weight(shape: tuple[int, int], fmt: Format) -> QuantizedWeight:
    out_features, in_features = shape
    group = fmt.group_size or in_features
    groups = ceil_div(in_features, group)
    if fmt.kind == UINT4:
        codes = torch.randint(0, 256, (out_features, in_features // 2), dtype=torch.uint8)
    elif fmt.kind == INT8:
        codes = torch.randint(-128, 128, (out_features, in_features), dtype=torch.int8)
    else:
        codes = (torch.randn(out_features, in_features) * 8).to(torch.float8_e4m3fn)
        codes = codes.view(torch.uint8)
    scales = torch.rand(out_features, groups) * 1e-3
    offsets = torch.rand(out_features, groups) * 1e-3 if fmt.offsets else None
    weight = QuantizedWeight(fmt.kind, codes, scales, offsets, group, in_features)
    return weight.to(torch.device("cuda"))


def seconds(run, repeats: int) -> float:
    """Median over ``repeats`` CUDA-event-timed calls of ``run``, after two to warm up."""
    run(), run()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,16,64,256,1024,4096")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.step.quantized_triton needs a CUDA device")
    device = torch.device("cuda")
    dense = [torch.randn(shape, device=device, dtype=torch.bfloat16) * 0.02 for shape in SHAPES]
    layers = {
        fmt.name: [
            QuantizedLinear(random_weight(shape, fmt), None, None, torch.bfloat16)
            for shape in SHAPES
        ]
        for fmt in FORMATS
    }
    flops_per_row = 2 * sum(out * inp for out, inp in SHAPES)
    print(torch.cuda.get_device_name())
    print(f"{'format':<14s}{'rows':>6s}{'us':>10s}{'vs bf16':>10s}{'GB/s':>9s}{'TFLOP/s':>9s}")
    for rows in [int(r) for r in args.rows.split(",")]:
        inputs = {inp: torch.randn(rows, inp, device=device, dtype=torch.bfloat16)
                  for _, inp in SHAPES}  # fmt: skip

        def bf16_pass(inputs=inputs) -> None:
            for weight in dense:
                F.linear(inputs[weight.shape[1]], weight)

        base = seconds(bf16_pass, args.repeats)
        candidates = [("bf16", base, sum(w.nbytes for w in dense))]
        for name, linears in layers.items():

            def quantized_pass(linears=linears, inputs=inputs) -> None:
                for layer in linears:
                    quantized_linear(inputs[layer.in_features], layer)

            nbytes = sum(layer.qweight.nbytes() for layer in linears)
            candidates.append((name, seconds(quantized_pass, args.repeats), nbytes))
        for name, elapsed, nbytes in candidates:
            print(
                f"{name:<14s}{rows:>6d}{elapsed * 1e6:>10.1f}{elapsed / base:>9.2f}x"
                f"{nbytes / elapsed / 1e9:>9.0f}{flops_per_row * rows / elapsed / 1e12:>9.1f}"
            )


if __name__ == "__main__":
    main()
