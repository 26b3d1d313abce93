"""What the Triton compiler makes of the attention kernels for a GPU, on any machine.

Triton's NVIDIA backend carries its own ``ptxas`` and ``cuobjdump``, so a kernel compiles to
machine code (SASS) for any architecture without a GPU. This prints, for each case: registers,
spilled stack and shared memory per program, how many loads the software pipeliner turned into
asynchronous copies and how many of those a wait in the loop leaves in flight (``num_stages``
buys nothing where every wait drains them all), and whether the machine
code is the same with the compiler's floating-point contraction on and off. The last is what
deterministic inference needs: a multiply and an add that the compiler fuses into one FMA
(rounding once) in one kind of key tile and not in another (rounding twice) give a query row
other bits by how its step was cut. Kernels whose every FMA is written out compile alike either
way.

A line per case, e.g. (Triton 3.9, sm_90; wrapped here)::

    decode q bf16, pages fp8, head 128, n128 w4 s2       REG:172 STACK:0, shared 41 KiB, 16 async
    copies, 0 left in flight

    python -m benchmarks.step.compiled_kernels [--arch 90] [--contraction] [--only prefill|decode]
        [--query fp32|fp16|bf16] [--num-stages N]

Exit status 1 with ``--contraction`` if a case's machine code depends on it. Figures come from
the Triton installed here, which may not be the GPU machine's.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import triton
import triton.backends.nvidia
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels.triton.decode_attention import _decode_kernel
from kernels.triton.prefill_attention import _prefill_kernel
from kernels.triton.tiles import (
    DecodeTiles,
    PrefillTiles,
    decode_tiles_for,
    prefill_tiles_for,
)

_QUERY_TYPES = {"fp32": "fp32", "fp16": "fp16", "bf16": "bf16"}
# Page element and scale types of each KV_QUANT flag ("none": pages in the query's type).
_PAGE_TYPES = {"fp8": ("fp8e4nv", "fp32"), "int8": ("i8", "u8")}
# Integer arguments that are not multiples of 16 in a typical launch; the JIT specialises the
# rest (and every pointer) as 16-divisible, which is what lets loads vectorise and go async.
_UNALIGNED = {
    "num_seqs",
    "num_splits",
    "stride_table_seq",
    "stride_out_split",
    "stride_scale_slot",
    "stride_scale_head",
}


@dataclass(frozen=True)
class Case:
    kernel: str  # "prefill" or "decode"
    query: str  # "fp32", "fp16" or "bf16"
    kv_quant: str  # "none", "fp8" or "int8"
    head_dim: int = 128
    group: int = 4
    tiles: PrefillTiles | DecodeTiles | None = None  # None: the table's for the architecture

    def tiles_for(self, arch: int) -> PrefillTiles | DecodeTiles:
        if self.tiles is not None:
            return self.tiles
        capability = (arch // 10, arch % 10)
        block_d = max(16, triton.next_power_of_2(self.head_dim))
        if self.kernel == "prefill":
            return prefill_tiles_for(capability, block_d, self.kv_quant)
        page_bytes = 1 if self.kv_quant != "none" else 4 if self.query == "fp32" else 2
        return decode_tiles_for(capability, block_d, self.kv_quant, page_bytes)

    def label(self, arch: int) -> str:
        return (
            f"{self.kernel} q {self.query}, pages {self.kv_quant}, head {self.head_dim}, "
            f"{self.tiles_for(arch)}"
        )


@dataclass(frozen=True)
class Compiled:
    ttgir: str
    sass: str
    resources: str  # cuobjdump's REG/STACK/SHARED line
    shared_bytes: int  # dynamic shared memory per program (the pipeline's buffers)

    @property
    def async_copies(self) -> int:
        return self.ttgir.count("async_copy_global_to_local") + self.ttgir.count(
            "async_tma_copy_global_to_local"
        )

    @property
    def copies_left_in_flight(self) -> int:
        """The most copy groups any wait leaves in flight: 0 means every wait drains them all,
        so no load runs more than one tile ahead of the math, whatever ``num_stages``."""
        return max(
            (int(n) for n in re.findall(r"async_wait [^{]*\{num = (\d+)", self.ttgir)), default=0
        )


def _signature(
    fn: triton.JITFunction, case: Case, tiles: PrefillTiles | DecodeTiles
) -> tuple[dict, dict, dict]:
    query = _QUERY_TYPES[case.query]
    page, scale = _PAGE_TYPES.get(case.kv_quant, (query, query))
    constexprs: dict[str, object] = {
        "GROUP": case.group,
        "HEAD_DIM": case.head_dim,
        "BLOCK_D": max(16, triton.next_power_of_2(case.head_dim)),
        "BLOCK_N": tiles.block_n,
        "KV_QUANT": case.kv_quant,
    }
    if isinstance(tiles, PrefillTiles):
        constexprs["BLOCK_M"] = max(tiles.block_m, triton.next_power_of_2(case.group))
    else:
        constexprs["BLOCK_G"] = max(16, triton.next_power_of_2(case.group))
    pointer_types = {
        "q_ptr": query,
        "out_ptr": query if case.kernel == "prefill" else "fp32",
        "lse_ptr": "fp32",
        "k_cache_ptr": page,
        "v_cache_ptr": page,
        "k_scale_ptr": scale,
        "v_scale_ptr": scale,
    }
    signature, attrs = {}, {}
    for index, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
            continue
        if name.endswith("_ptr"):
            signature[name] = "*" + pointer_types.get(name, "i32")
        else:
            signature[name] = "fp32" if name == "qk_scale" else "i32"
        if name != "qk_scale" and name not in _UNALIGNED:
            attrs[(index,)] = [["tt.divisibility", 16]]
    return signature, constexprs, attrs


def _tool(name: str) -> str:
    return str(Path(triton.backends.nvidia.__file__).parent / "bin" / name)


def compile_case(case: Case, arch: int, fp_fusion: bool = True) -> Compiled:
    fn = _prefill_kernel if case.kernel == "prefill" else _decode_kernel
    tiles = case.tiles_for(arch)
    signature, constexprs, attrs = _signature(fn, case, tiles)
    kernel = triton.compile(
        ASTSource(fn, signature, constexprs, attrs),
        target=GPUTarget("cuda", arch, 32),
        options={
            "num_warps": tiles.num_warps,
            "num_stages": tiles.num_stages,
            "enable_fp_fusion": fp_fusion,
        },
    )
    sass, resources = _disassemble(kernel.asm["cubin"])
    return Compiled(kernel.asm["ttgir"], sass, resources, kernel.metadata.shared)


def _disassemble(cubin: bytes) -> tuple[str, str]:
    """The instructions of a cubin (addresses and encodings stripped) and its resource line."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        sass = subprocess.run(
            [_tool("cuobjdump"), "-sass", file.name], capture_output=True, text=True, check=True
        ).stdout
        usage = subprocess.run(
            [_tool("cuobjdump"), "-res-usage", file.name],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    instructions = [
        line.split("*/", 1)[1].split(";", 1)[0].strip()
        for line in sass.splitlines()
        if line.strip().startswith("/*") and "*/" in line and ";" in line
    ]
    resources = next((line.strip() for line in usage.splitlines() if "REG:" in line), "?")
    return "\n".join(instructions), resources


# Deterministic inference runs every step through the prefill kernel: its cases come first, over
# every kind of page, and float32 queries among them (16-bit ones round the difference away).
CASES = [
    Case("prefill", "fp32", "none", head_dim=64),
    Case("prefill", "fp32", "fp8", head_dim=64),
    Case("prefill", "fp32", "int8", head_dim=64),
    Case("prefill", "bf16", "none"),
    Case("prefill", "bf16", "fp8"),
    Case("prefill", "bf16", "int8"),
    Case("prefill", "fp16", "fp8"),
    Case("decode", "bf16", "none"),
    Case("decode", "bf16", "fp8"),
    Case("decode", "bf16", "int8"),
]


def contraction_differs(case: Case, arch: int) -> bool:
    """Whether the case's machine code changes when the compiler may not fuse mul + add."""
    return compile_case(case, arch, fp_fusion=True).sass != compile_case(case, arch, False).sass


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90, 80")
    parser.add_argument(
        "--contraction",
        action="store_true",
        help="also compile without FP contraction and compare the machine code",
    )
    parser.add_argument("--only", choices=("prefill", "decode"), help="one kernel's cases")
    parser.add_argument("--query", choices=tuple(_QUERY_TYPES), help="one query type's cases")
    parser.add_argument("--num-stages", type=int, help="in place of the table's, for every case")
    args = parser.parse_args()
    # Triton decides between compiler and interpreter when a kernel is decorated.
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("benchmarks.step.compiled_kernels compiles the kernels: run it without "
              "TRITON_INTERPRET")  # fmt: skip
        return 2
    print(f"triton {triton.__version__}, sm_{args.arch}")
    failed = False
    for case in CASES:
        if args.only not in (None, case.kernel) or args.query not in (None, case.query):
            continue
        if args.num_stages is not None:
            case = replace(
                case, tiles=replace(case.tiles_for(args.arch), num_stages=args.num_stages)
            )
        compiled = compile_case(case, args.arch)
        registers = compiled.resources.split(" SHARED")[0]
        line = (
            f"  {case.label(args.arch):52} {registers}, shared {compiled.shared_bytes // 1024} "
            f"KiB, {compiled.async_copies} async copies, {compiled.copies_left_in_flight} left "
            "in flight"
        )
        if args.contraction:
            same = compiled.sass == compile_case(case, args.arch, fp_fusion=False).sass
            failed |= not same
            line += ", contraction: " + ("same machine code" if same else "DIFFERS")
        print(line, flush=True)
    return int(failed)


if __name__ == "__main__":
    sys.exit(main())
