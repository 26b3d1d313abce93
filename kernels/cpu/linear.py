"""Linear layers on the CPU: weights stored the way this machine's fastest GEMMs want them.

Three kernels compete, and which is faster depends on the processor and on the row count:

- **tiles** (``kernels/cpu/linear_tiles.c``): the weight prepacked, in the model's dtype (bf16
  or float32), into tiles of 32 output columns, each one sequential stream (bf16 widened to
  float32 as it is read). A decode step is a stream over the weights, and bf16 tiles read half
  the bytes of fp32 at memory speed; every output is summed in one fixed order, whatever the
  row count, so a row's result does not depend on the rows beside it;
- **float32 BLAS** (MKL): the weight widened once to float32 and stored transposed
  (``[in, out]``), the layout MKL runs fastest. With many rows (prefill) it can beat the tiles
  on some processors, but it blocks its sums by the shape of the call;
- **bf16 BLAS** (oneDNN, through torch's bf16 GEMM): the processor's own bf16 arithmetic, AMX
  tiles or ``vdpbf16ps``, two products per 32-bit lane, where it has them. On a Xeon with AMX it
  runs prefill-sized GEMMs 5-8x faster than float32 MKL; where a processor has no bf16 units
  oneDNN emulates them at half MKL's speed, and the probe keeps float32.

All three multiply exactly (a product of two bf16 values is exact in float32), sum in float32
and round the output to the model's dtype once, so the choice changes the summation order, not
the computation: a bf16 model's hidden states are bf16 either way. ``choose_gemm_plan`` times
them over the model's own weights at start-up: first which BLAS (at a prefill-sized row count),
then, per row count, the tiles against it; only the forms the chosen plan uses are kept in
memory. Deterministic inference takes the tiles at every row count (``TILES_ONLY``), whatever
the probe would say. Float32 layers (a bf16 model's int8 turns) never take the bf16 BLAS: that
would round their inputs.

The choice is made once per machine and model shape and kept on disk beside the kernels: a
different summation order rounds some bf16 outputs differently, so two processes that chose
differently (timings are noisy, and the kernels are often close) would not give the same
tokens. Every worker on a machine, and the one-process engine, run the same plan.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from kernels.cpu import library as cpu_library
from kernels.cpu.tile_choice import publish_first
from kernels.sizes import ceil_div
from kernels.timing import first_is_faster

logger = logging.getLogger(__name__)

# Row counts the probe times: decode batches and verification runs, then prefill-sized chunks.
# BLAS gains on the tiles as rows grow (on the AVX-512 Xeon the two were even at 128 rows and
# BLAS 10-20% faster at 1024 and 2048), so a long prefill chunk gets a probe of its own size.
PROBE_ROWS = (1, 8, 32, 128, 1024)
# Past this many rows both kernels are bound by arithmetic, not by reading the weights, and the
# first PROBE_LINEARS_MANY_ROWS layers time them as well as the whole model does (all 30 of
# SmolLM2's layers at 1024 rows would add 24 s to the first start on a 2-core machine).
PROBE_ALL_LINEARS_UP_TO = 128
PROBE_LINEARS_MANY_ROWS = 8
# Output columns per prepacked tile; must match TILE in kernels/cpu/linear_tiles.c.
TILE = 32
# Up to this many rows the bf16 BLAS multiplies a weight that oneDNN reordered once, at load,
# into its own blocked layout (``weight_onednn``); torch's bf16 linear reorders the weight on
# every call, which a few hundred rows do not amortise. On the 2-core AMX Xeon, SmolLM2's 30
# layers: 256 rows 44 vs 62 ms, 512 rows 84 vs 108 ms, 768 rows 129 vs 138 ms; from ~900 rows
# the call's own reorder is the faster (1024 rows: 176 vs 164 ms). Both give the same bits.
ONEDNN_PACKED_MAX_ROWS = 768
# The row count oneDNN is told to expect when it chooses the reordered layout.
ONEDNN_PACKED_ROWS_HINT = 512


# The BLAS a plan's rows past the tiles run, for bf16 layers (float32 layers run float32's);
# EITHER_BLAS is the probe's: a layer packed with it holds both forms, and runs bf16's.
FLOAT32_BLAS = "float32"
BF16_BLAS = "bfloat16"
EITHER_BLAS = "either"


@dataclass(frozen=True, slots=True)
class GemmPlan:
    """Rows up to ``tile_max_rows`` run the tile kernel, the rest BLAS in ``blas_dtype``.

    ``tile_max_rows`` is 0 when the tiles are never used and None when they always are."""

    tile_max_rows: int | None
    blas_dtype: str = FLOAT32_BLAS

    @property
    def uses_tiles(self) -> bool:
        return self.tile_max_rows is None or self.tile_max_rows > 0

    @property
    def uses_blas(self) -> bool:
        return self.tile_max_rows is not None

    @property
    def uses_bf16_blas(self) -> bool:
        return self.uses_blas and self.blas_dtype in (BF16_BLAS, EITHER_BLAS)

    @property
    def uses_float32_blas(self) -> bool:
        return self.uses_blas and self.blas_dtype in (FLOAT32_BLAS, EITHER_BLAS)

    def describe(self) -> str:
        blas = {FLOAT32_BLAS: "BLAS", BF16_BLAS: "bf16 BLAS", EITHER_BLAS: "either BLAS"}
        blas = blas[self.blas_dtype]
        if not self.uses_blas:
            return "tile GEMMs at every row count"
        if not self.uses_tiles:
            return f"{blas} GEMMs at every row count"
        return f"tile GEMMs up to {self.tile_max_rows} rows, {blas} beyond"


class StepShape:
    """What every ``CpuLinear`` of one model knows about the step it runs in (set once per
    forward by the model).

    A step of decode and verification runs only (``short_runs_only``) takes the tiles at any
    row count: they sum each row in the same order whatever the row count, so a sequence's
    tokens do not depend on how many rows share its step, and speculation, which adds rows,
    changes no token. Steps with prefill chunks take the plan's kernel for their row count."""

    __slots__ = ("short_runs_only",)

    def __init__(self) -> None:
        self.short_runs_only = False


BLAS_ONLY = GemmPlan(tile_max_rows=0)
TILES_ONLY = GemmPlan(tile_max_rows=None)
# What a layer is packed with while the probe runs: every form, so that it can time each.
BOTH = GemmPlan(tile_max_rows=PROBE_ROWS[-1], blas_dtype=EITHER_BLAS)
# Weight dtypes the tile kernel reads.
TILE_DTYPES = (torch.bfloat16, torch.float32)


# How a bf16 tile's 32 columns are laid out in a k-row, by ``pdserve_bf16_tile_order``: as
# (groups, words) per row, word i of a group holding the group's column i in its low half and
# column i + words in its high half, so that a shift and a mask widen a vector of them.
BF16_COLUMN_PAIRS = {1: (2, 8), 2: (1, 16)}
# The order of the kernels on the processor's bf16 units (kernels/cpu/bf16_pair_tiles.c): k-rows
# in pairs, K padded to a multiple of PAIR_K_BLOCK, word j of a pair holding column j of its
# first k-row in its low half and of its second in its high half, the operand AMX's and
# AVX512_BF16's dot products multiply.
BF16_K_ROW_PAIRS = 3
# k of one AMX tile; must match PAIR_K_BLOCK in bf16_pair_tiles.c.
PAIR_K_BLOCK = 32


def bf16_tile_order() -> int:
    """This machine's tile kernel's order of bf16 weights (``pdserve_bf16_tile_order``)."""
    return cpu_library.load().pdserve_bf16_tile_order()


def bf16_column_pairs() -> tuple[int, int] | None:
    """(groups, words) of this machine's tile kernel's paired bf16 columns (``BF16_COLUMN_PAIRS``),
    or None where it reads the columns in order."""
    return BF16_COLUMN_PAIRS.get(bf16_tile_order())


def pack_tiles(weight: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` -> ``[ceil(N / TILE), K, TILE]`` contiguous, columns past N zero, each tile's
    weights in the order the kernel reads them (``bf16_tile_order``; K padded with zero rows to
    a multiple of PAIR_K_BLOCK where it reads k-rows in pairs)."""
    out_features, in_features = weight.shape
    padded = ceil_div(out_features, TILE) * TILE
    transposed = F.pad(weight.detach().t(), (0, padded - out_features))
    tiles = transposed.reshape(in_features, padded // TILE, TILE).permute(1, 0, 2)
    if weight.dtype != torch.bfloat16:
        return tiles.contiguous()
    order = bf16_tile_order()
    if order == BF16_K_ROW_PAIRS:
        # [tile, k, column] -> [tile, pair, column, k of the pair]: word j holds both k-rows.
        tiles = F.pad(
            tiles, (0, 0, 0, ceil_div(in_features, PAIR_K_BLOCK) * PAIR_K_BLOCK - in_features)
        )
        return tiles.unflatten(1, (-1, 2)).transpose(-1, -2).reshape(tiles.shape).contiguous()
    pairs = BF16_COLUMN_PAIRS.get(order)
    if pairs is not None:
        # [.., group, half, word] -> [.., group, word, half]: word i holds columns i, i + words.
        groups, words = pairs
        tiles = tiles.unflatten(-1, (groups, 2, words)).transpose(-1, -2).flatten(-3)
    return tiles.contiguous()


def unpack_tiles(tiles: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """The ``[N, K]`` weight that ``pack_tiles`` packed into ``tiles``."""
    if tiles.dtype == torch.bfloat16:
        order = bf16_tile_order()
        if order == BF16_K_ROW_PAIRS:
            num_tiles = tiles.shape[0]
            tiles = tiles.reshape(num_tiles, -1, TILE, 2).transpose(-1, -2).flatten(1, 2)
        pairs = BF16_COLUMN_PAIRS.get(order)
        if pairs is not None:
            groups, words = pairs
            tiles = tiles.unflatten(-1, (groups, words, 2)).transpose(-1, -2).flatten(-3)
    num_tiles = tiles.shape[0]
    tiles = tiles[:, :in_features]
    return tiles.permute(1, 0, 2).reshape(in_features, num_tiles * TILE)[:, :out_features].t()


class CpuLinear(nn.Module):
    """``y = x W^T + b`` in the model's dtype, through the kernel the plan picks for x's rows."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        plan: GemmPlan,
        step: StepShape | None = None,
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype
        if plan.uses_tiles and self.dtype not in TILE_DTYPES:
            raise ValueError(f"the tile GEMM reads bf16 or float32 weights, not {self.dtype}")
        self.plan = plan
        self.step = step or StepShape()
        self.packed_tiles = None
        self.bias_tiles = None
        if plan.uses_tiles:
            self.packed_tiles = pack_tiles(weight)
            self.bias_tiles = None if bias is None else bias.detach().to(torch.float32)
        self.weight_t32 = None
        self.bias32 = None
        if plan.uses_float32_blas or (plan.uses_blas and self.dtype != torch.bfloat16):
            self.weight_t32 = weight.detach().to(torch.float32).t().contiguous()
            self.bias32 = None if bias is None else bias.detach().to(torch.float32)
        self.weight_bf16 = None
        self.bias_bf16 = None
        self.weight_onednn = None
        if plan.uses_bf16_blas and self.dtype == torch.bfloat16:
            # [out, in], the layout torch's bf16 linear hands oneDNN without a copy.
            self.weight_bf16 = weight.detach().contiguous()
            self.bias_bf16 = None if bias is None else bias.detach().to(torch.bfloat16)
            self.weight_onednn = onednn_packed_weight(self.weight_bf16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        limit = self.plan.tile_max_rows
        if self.packed_tiles is not None and (
            limit is None or x.shape[0] <= limit or self.step.short_runs_only
        ):
            return self.forward_tiles(x)
        return self.forward_blas(x)

    def forward_tiles(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.dtype:
            raise ValueError(f"this layer takes {self.dtype} inputs, got {x.dtype}")
        if x.stride(-1) != 1:
            x = x.contiguous()
        out = torch.empty((x.shape[0], self.out_features), dtype=self.dtype)
        library = cpu_library.load()
        kernel = (
            library.pdserve_linear_bf16
            if self.dtype == torch.bfloat16
            else (library.pdserve_linear_f32)
        )
        status = kernel(
            x.data_ptr(),
            x.stride(0),
            self.packed_tiles.data_ptr(),
            None if self.bias_tiles is None else self.bias_tiles.data_ptr(),
            out.data_ptr(),
            out.stride(0),
            x.shape[0],
            self.out_features,
            self.in_features,
            torch.get_num_threads(),
        )
        if status != 0:
            raise MemoryError("the tile GEMM kernel could not allocate its scratch memory")
        return out

    def forward_blas(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight_bf16 is not None and self.plan.blas_dtype != FLOAT32_BLAS:
            return self.forward_bf16_blas(x)
        return self.forward_float32_blas(x)

    def forward_bf16_blas(self, x: torch.Tensor) -> torch.Tensor:
        """oneDNN's bf16 GEMM: products of bf16 values summed in float32 by the processor's
        bf16 units (AMX, ``vdpbf16ps``), the output rounded to bf16 once."""
        if x.dtype != torch.bfloat16:
            raise ValueError(f"this layer takes bf16 inputs, got {x.dtype}")
        if self.weight_onednn is not None and x.shape[0] <= ONEDNN_PACKED_MAX_ROWS:
            return torch.ops.mkldnn._linear_pointwise(
                x, self.weight_onednn, self.bias_bf16, "none", [], ""
            )
        return F.linear(x, self.weight_bf16, self.bias_bf16)

    def forward_float32_blas(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.to(torch.float32)
        if self.bias32 is None:
            out = torch.mm(x32, self.weight_t32)
        else:
            out = torch.addmm(self.bias32, x32, self.weight_t32)
        return out.to(self.dtype)

    def restrict(self, plan: GemmPlan) -> None:
        """Switch to ``plan`` (which may use fewer kernels) and drop the forms it does not use."""
        if plan.uses_tiles and self.packed_tiles is None:
            raise ValueError("this layer holds no prepacked tiles")
        bf16_blas = plan.uses_bf16_blas and self.dtype == torch.bfloat16
        if bf16_blas and self.weight_bf16 is None:
            raise ValueError("this layer holds no bf16 weight for the bf16 BLAS")
        if plan.uses_blas and not bf16_blas and self.weight_t32 is None:
            raise ValueError("this layer holds no fp32 weight")
        self.plan = plan
        if not plan.uses_tiles:
            self.packed_tiles = self.bias_tiles = None
        if not bf16_blas:
            self.weight_bf16 = self.bias_bf16 = self.weight_onednn = None
        if not plan.uses_blas or (bf16_blas and plan.blas_dtype == BF16_BLAS):
            self.weight_t32 = self.bias32 = None

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, {self.plan.describe()}"


def onednn_reorders_bf16() -> bool:
    """Whether oneDNN can reorder a bf16 weight on this processor: it needs AVX-512 (BW, VL,
    DQ) or AVX-NE-CONVERT, so not on an AVX2-only core, where torch's bf16 linear still runs."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def onednn_packed_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight [out, in]`` (bf16) reordered once into oneDNN's blocked layout for
    ``torch.ops.mkldnn._linear_pointwise``; None where oneDNN cannot (``onednn_reorders_bf16``)."""
    if not onednn_reorders_bf16():
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight, ONEDNN_PACKED_ROWS_HINT)


# Both forms of every weight are held while the probe runs; past this many bytes of fp32
# weights that is too much memory to spend, and such a model runs the bf16 tiles only.
PROBE_MAX_FP32_BYTES = 4 << 30


def probe_plan(dtype: torch.dtype, num_params: int, deterministic: bool = False) -> GemmPlan:
    """The plan to pack with before ``choose_gemm_plan``: both kernels where a probe will
    choose between them, else the one kernel there is to use. bf16 models are probed; float32
    models (the reference dtype) run BLAS. ``deterministic`` takes the tiles, whose sums do not
    depend on the row count, at every row count."""
    if deterministic:
        if dtype not in TILE_DTYPES or not cpu_library.available():
            raise ValueError(
                "deterministic inference on a CPU needs the C kernels (a C compiler) and a "
                f"bfloat16 or float32 model, not {dtype}"
            )
        return TILES_ONLY
    if dtype != torch.bfloat16 or not cpu_library.available():
        return BLAS_ONLY
    if num_params * 4 > PROBE_MAX_FP32_BYTES:
        return TILES_ONLY
    return BOTH


def choose_gemm_plan(linears: list[CpuLinear]) -> GemmPlan:
    """The plan this machine chose for these layers' shapes, probing it on first use (see
    ``_probe_plan``). Concurrent first uses agree: the first plan written is the one kept."""
    path = _plan_path(linears)
    return _read_plan(path) or publish_first(path, _probe_plan(linears), _encode_plan, _read_plan)


def _encode_plan(plan: GemmPlan) -> str:
    return json.dumps({"tile_max_rows": plan.tile_max_rows, "blas_dtype": plan.blas_dtype})


def _plan_path(linears: list[CpuLinear]) -> Path:
    digest = hashlib.sha256(cpu_library.build_digest().encode())
    for linear in linears:
        digest.update(f"{linear.out_features}x{linear.in_features};".encode())
    # The kernels a plan chooses between: a plan probed before bf16's BLAS competed, or with
    # another bf16 tile kernel, is stale; so is one timed by wall clock, which a busy machine's
    # waits for a core could reverse (first_is_faster).
    kernels = (PROBE_ROWS, FLOAT32_BLAS, BF16_BLAS, cpu_library.bf16_tiles(), "running time")
    digest.update(repr(kernels).encode())
    return cpu_library.cache_dir() / f"gemm-plan-{digest.hexdigest()[:16]}.json"


def _read_plan(path: Path) -> GemmPlan | None:
    """The plan stored at ``path``; None if there is none or it is not a plan."""
    try:
        stored = json.loads(path.read_text())
        limit = stored["tile_max_rows"]
        blas_dtype = stored.get("blas_dtype", FLOAT32_BLAS)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if limit is not None and (not isinstance(limit, int) or limit < 0):
        return None
    if blas_dtype not in (FLOAT32_BLAS, BF16_BLAS):
        return None
    return GemmPlan(tile_max_rows=limit, blas_dtype=blas_dtype)


def _probe_plan(linears: list[CpuLinear]) -> GemmPlan:
    """Time the kernels over the model's own linear layers (packed with ``BOTH``), in order, and
    return the plan of the fastest: first which BLAS, at the largest of ``PROBE_ROWS`` (where
    BLAS is at its best against the tiles); then the tiles against that BLAS at each of them.

    Real weights matter: one layer's matrices would sit in cache and flatter the kernel that
    reads more bytes. Past the largest probed row count, whichever won there keeps winning;
    below it, rows past the last count the tiles won at run BLAS."""
    blas_dtype = _probe_blas_dtype(linears)
    tiles_win: list[bool] = []
    for rows in PROBE_ROWS:
        probed, inputs = _probe_inputs(linears, rows)
        tiles = _runner(probed, inputs, lambda linear: "forward_tiles")
        blas = _runner(probed, inputs, lambda linear: _blas_kernel(linear, blas_dtype))
        tiles_win.append(first_is_faster(tiles, blas))
    if all(tiles_win):
        return TILES_ONLY
    limit = 0
    for rows, wins in zip(PROBE_ROWS, tiles_win, strict=True):
        if not wins:
            break
        limit = rows
    return GemmPlan(tile_max_rows=limit, blas_dtype=blas_dtype)


def _probe_blas_dtype(linears: list[CpuLinear]) -> str:
    """bf16's BLAS where it beats float32's over the bf16 layers at prefill-sized rows (the
    processor has bf16 units: AMX, ``vdpbf16ps``), else float32's."""
    bf16_linears = [linear for linear in linears if linear.weight_bf16 is not None]
    if not bf16_linears:
        return FLOAT32_BLAS
    probed, inputs = _probe_inputs(bf16_linears, PROBE_ROWS[-1])
    bf16_wins = first_is_faster(
        _runner(probed, inputs, lambda linear: "forward_bf16_blas"),
        _runner(probed, inputs, lambda linear: "forward_float32_blas"),
    )
    return BF16_BLAS if bf16_wins else FLOAT32_BLAS


def _runner(
    probed: list[CpuLinear],
    inputs: dict[tuple[int, torch.dtype], torch.Tensor],
    kernel_of: Callable[[CpuLinear], str],
) -> Callable[[], None]:
    """A call that runs every probed layer, each through the kernel ``kernel_of`` names, over
    the input of its width and dtype: what the probe times."""

    def run() -> None:
        for linear in probed:
            getattr(linear, kernel_of(linear))(inputs[linear.in_features, linear.dtype])

    return run


def _blas_kernel(linear: CpuLinear, blas_dtype: str) -> str:
    if blas_dtype == BF16_BLAS and linear.weight_bf16 is not None:
        return "forward_bf16_blas"
    return "forward_float32_blas"


def _probe_inputs(
    linears: list[CpuLinear], rows: int
) -> tuple[list[CpuLinear], dict[tuple[int, torch.dtype], torch.Tensor]]:
    """The layers a probe at ``rows`` rows times, and an input for each (in, dtype) they take:
    each layer in its own dtype, since an int8 pool's turns stay float32 in a bf16 model."""
    probed = linears if rows <= PROBE_ALL_LINEARS_UP_TO else linears[:PROBE_LINEARS_MANY_ROWS]
    inputs = {
        (size, dtype): torch.randn(rows, size, dtype=dtype)
        for size, dtype in {(linear.in_features, linear.dtype) for linear in probed}
    }
    return probed, inputs
