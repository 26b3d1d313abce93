"""The linear layers of a step over quantized weights against bf16 ones, on this CPU.

SmolLM2-135M's linear shapes with random weights: every layer's fused q/k/v (960 x 576), o
(576 x 576), gate_up (3072 x 576) and down (576 x 1536), ``--layers`` times over (30, the
model's: a decode step streams every layer's weights from memory, not one layer's from cache),
and the output head (49152 x 576). For each row count, one pass over all of them with:

- bf16 ``CpuLinear``, packed and planned as the engine does (``probe_plan``, then
  ``choose_gemm_plan``: tiles or BLAS by row count, timed on this machine on first use);
- ``CpuQuantizedLinear`` over int8 codes (groups of 32; per output channel), uint4 codes
  (groups of 32 with offsets; groups of 64 without) and FP8 e4m3 codes (per channel); int8 and
  uint4 codes in the integer sums where this processor has AVX512_VNNI, and then again in the
  float32 tiles, as "(float)".

Printed per (format, rows): milliseconds per pass, the ratio to bf16's, and the weight floor
(the bytes the pass reads over the rate this machine reads memory at, measured with a large
read)::

    format               rows   ms/pass   vs bf16   floor ms   MB read
    bf16                    1     18.05     1.00x      17.91     269.0

    python -m benchmarks.step.quantized_gemm [--rows 1,8,32,512] [--layers 30] [--repeats 5]
        [--threads N]
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from benchmarks.harness import memory_read_seconds
from kernels.cpu.linear import CpuLinear, StepShape, choose_gemm_plan, probe_plan
from kernels.cpu.quantized_linear import CpuQuantizedLinear, integer_sums_fit
from kernels.quantized import FP8_E4M3, INT8, UINT4, QuantizedWeight
from kernels.sizes import ceil_div
from kernels.timing import running_seconds

HIDDEN = 576
# (out_features, in_features) of one layer's linears: fused q/k/v, o, gate_up, down.
LAYER_SHAPES = [(960, HIDDEN), (HIDDEN, HIDDEN), (3072, HIDDEN), (HIDDEN, 1536)]
HEAD_SHAPE = (49152, HIDDEN)
# Bytes of the buffer read to measure the memory's read rate: far past any cache.
BANDWIDTH_BYTES = 2 << 30


@dataclass(frozen=True, slots=True)
class Format:
    name: str
    kind: str
    group_size: int | None  # None: per output channel (one group over the whole row)
    offsets: bool


FORMATS = [
    Format("int8 g32", INT8, 32, False),
    Format("int8 per-channel", INT8, None, False),
    Format("uint4 g32 offsets", UINT4, 32, True),
    Format("uint4 g64", UINT4, 64, False),
    Format("fp8 per-channel", FP8_E4M3, None, False),
]


def random_quantized(shape: tuple[int, int], fmt: Format, generator) -> QuantizedWeight:
    out_features, in_features = shape
    group = fmt.group_size or in_features
    groups = (out_features, ceil_div(in_features, group))
    if fmt.kind == INT8:
        codes = torch.randint(-128, 128, shape, generator=generator).to(torch.int8)
    elif fmt.kind == UINT4:
        width = ceil_div(in_features, 2)
        codes = torch.randint(0, 256, (out_features, width), generator=generator).to(torch.uint8)
    else:
        values = torch.randn(shape, generator=generator) * 64
        codes = values.to(torch.float8_e4m3fn).view(torch.uint8)
    scales = torch.rand(groups, generator=generator) * 1e-3
    offsets = torch.rand(groups, generator=generator) * 1e-2 if fmt.offsets else None
    return QuantizedWeight(fmt.kind, codes, scales, offsets, group, in_features)


def model_shapes(layers: int) -> list[tuple[int, int]]:
    return LAYER_SHAPES * layers + [HEAD_SHAPE]


def bf16_linears(shapes: list[tuple[int, int]], generator) -> list[CpuLinear]:
    """bf16 layers as ``CpuKernels`` makes them: packed for every kernel, planned, restricted."""
    weights = [torch.randn(shape, generator=generator).to(torch.bfloat16) for shape in shapes]
    num_params = sum(weight.numel() for weight in weights)
    plan = probe_plan(torch.bfloat16, num_params)
    step = StepShape()
    linears = [CpuLinear(weight, None, plan, step) for weight in weights]
    del weights
    plan = choose_gemm_plan(linears)
    for linear in linears:
        linear.restrict(plan)
    print(f"bf16 plan: {plan.describe()}")
    return linears


def pass_seconds(linears, inputs: dict[int, torch.Tensor], repeats: int) -> float:
    def run() -> None:
        for linear in linears:
            linear(inputs[linear.in_features])

    run()
    # running_seconds: the machine's other work delays a call, not the kernel.
    return min(running_seconds(run) for _ in range(repeats))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,8,32,512", help="row counts, comma-separated")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="default: torch's")
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    rows_list = [int(rows) for rows in args.rows.split(",")]
    shapes = model_shapes(args.layers)
    generator = torch.Generator().manual_seed(0)

    read_rate = BANDWIDTH_BYTES / memory_read_seconds(BANDWIDTH_BYTES, args.repeats)
    print(f"memory read rate: {read_rate / 1e9:.1f} GB/s, {torch.get_num_threads()} threads")
    bf16 = bf16_linears(shapes, generator)
    bf16_bytes = sum(2 * out_features * in_features for out_features, in_features in shapes)
    inputs = {
        rows: {
            size: torch.randn(rows, size, generator=generator).to(torch.bfloat16)
            for size in {in_features for _, in_features in shapes}
        }
        for rows in rows_list
    }
    baseline = {rows: pass_seconds(bf16, inputs[rows], args.repeats) for rows in rows_list}
    del bf16

    header = (
        f"{'format':<20} {'rows':>5} {'ms/pass':>9} {'vs bf16':>8} {'floor ms':>9} {'MB read':>8}"
    )
    print(header)

    def report(name: str, rows: int, seconds: float, nbytes: int) -> None:
        print(
            f"{name:<20} {rows:>5} {seconds * 1e3:>9.2f} {seconds / baseline[rows]:>7.2f}x "
            f"{nbytes / read_rate * 1e3:>9.2f} {nbytes / 1e6:>8.1f}"
        )

    for rows in rows_list:
        report("bf16", rows, baseline[rows], bf16_bytes)
    for fmt in FORMATS:
        weights = [random_quantized(shape, fmt, generator) for shape in shapes]
        # Integer codes run their integer sums where this processor has them, and the float32
        # tiles beside them.
        kernels = [None]
        if integer_sums_fit(weights[0]):
            kernels.append(False)
        for integer_sums in kernels:
            linears = [
                CpuQuantizedLinear(weight, None, torch.bfloat16, integer_sums=integer_sums)
                for weight in weights
            ]
            name = fmt.name if integer_sums is None else f"{fmt.name} (float)"
            nbytes = sum(linear.packed.tiles.nbytes for linear in linears)
            for rows in rows_list:
                report(name, rows, pass_seconds(linears, inputs[rows], args.repeats), nbytes)
            del linears


if __name__ == "__main__":
    main()
