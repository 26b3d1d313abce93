"""Linear layers on the CPU: weights stored the way this machine's fastest GEMMs want them.

Two kernels compete, and which is faster depends on the processor and on the row count:

- **tiles** (``kernels/cpu/linear_tiles.c``): the weight prepacked, in the model's dtype (bf16
  or float32), into tiles of 32 output columns, each one sequential stream (bf16 widened to
  float32 as it is read). A decode step is a stream over the weights, and bf16 tiles read half
  the bytes of fp32 at memory speed; every output is summed in one fixed order, whatever the
  row count, so a row's result does not depend on the rows beside it;
- **BLAS** (MKL): the weight widened once to float32 and stored transposed (``[in, out]``), the
  layout MKL runs fastest. With many rows (prefill) it can beat the tiles on some processors,
  but it blocks its sums by the shape of the call.

Both multiply exactly (a bf16 value widened to float32 is exact), sum in float32 and round the
output to the model's dtype once, so the choice changes the summation order, not the
computation: a bf16 model's hidden states are bf16 either way. ``choose_gemm_plan`` times both
over the model's own weights at start-up and picks, per row count, the faster; only the forms
the chosen plan uses are kept in memory. Deterministic inference takes the tiles at every row
count (``TILES_ONLY``), whatever the probe would say.

The choice is made once per machine and model shape and kept on disk beside the kernels: a
different summation order rounds some bf16 outputs differently, so two processes that chose
differently (timings are noisy, and the kernels are often close) would not give the same
tokens. Every worker on a machine, and the one-process engine, run the same plan.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from kernels import cpu_library
from kernels.sizes import ceil_div

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


@dataclass(frozen=True, slots=True)
class GemmPlan:
    """Rows up to ``tile_max_rows`` run the tile kernel, the rest BLAS.

    ``tile_max_rows`` is 0 when the tiles are never used and None when they always are."""

    tile_max_rows: int | None

    @property
    def uses_tiles(self) -> bool:
        return self.tile_max_rows is None or self.tile_max_rows > 0

    @property
    def uses_blas(self) -> bool:
        return self.tile_max_rows is not None

    def describe(self) -> str:
        if not self.uses_blas:
            return "tile GEMMs at every row count"
        if not self.uses_tiles:
            return "BLAS GEMMs at every row count"
        return f"tile GEMMs up to {self.tile_max_rows} rows, BLAS beyond"


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
BOTH = GemmPlan(tile_max_rows=PROBE_ROWS[-1])
# Weight dtypes the tile kernel reads.
TILE_DTYPES = (torch.bfloat16, torch.float32)


# How a bf16 tile's 32 columns are laid out in a k-row, by ``pdserve_bf16_tile_order``: as
# (groups, words) per row, word i of a group holding the group's column i in its low half and
# column i + words in its high half, so that a shift and a mask widen a vector of them.
BF16_COLUMN_PAIRS = {1: (2, 8), 2: (1, 16)}


def bf16_column_pairs() -> tuple[int, int] | None:
    """(groups, words) of this machine's tile kernel's paired bf16 columns (``BF16_COLUMN_PAIRS``),
    or None where it reads the columns in order."""
    return BF16_COLUMN_PAIRS.get(cpu_library.load().pdserve_bf16_tile_order())


def pack_tiles(weight: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` -> ``[ceil(N / TILE), K, TILE]`` contiguous, columns past N zero, each tile's
    columns in the order the kernel reads them (``bf16_column_pairs``)."""
    out_features, in_features = weight.shape
    padded = ceil_div(out_features, TILE) * TILE
    transposed = F.pad(weight.detach().t(), (0, padded - out_features))
    tiles = transposed.reshape(in_features, padded // TILE, TILE).permute(1, 0, 2)
    pairs = bf16_column_pairs() if weight.dtype == torch.bfloat16 else None
    if pairs is not None:
        # [.., group, half, word] -> [.., group, word, half]: word i holds columns i, i + words.
        groups, words = pairs
        tiles = tiles.unflatten(-1, (groups, 2, words)).transpose(-1, -2).flatten(-3)
    return tiles.contiguous()


def unpack_tiles(tiles: torch.Tensor, out_features: int) -> torch.Tensor:
    """The ``[N, K]`` weight that ``pack_tiles`` packed into ``tiles``."""
    pairs = bf16_column_pairs() if tiles.dtype == torch.bfloat16 else None
    if pairs is not None:
        groups, words = pairs
        tiles = tiles.unflatten(-1, (groups, words, 2)).transpose(-1, -2).flatten(-3)
    num_tiles, in_features, _ = tiles.shape
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
        if plan.uses_blas:
            self.weight_t32 = weight.detach().to(torch.float32).t().contiguous()
            self.bias32 = None if bias is None else bias.detach().to(torch.float32)

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
        if plan.uses_blas and self.weight_t32 is None:
            raise ValueError("this layer holds no fp32 weight")
        self.plan = plan
        if not plan.uses_tiles:
            self.packed_tiles = self.bias_tiles = None
        if not plan.uses_blas:
            self.weight_t32 = self.bias32 = None

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, {self.plan.describe()}"


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
    return _read_plan(path) or _publish(path, _probe_plan(linears))


def _plan_path(linears: list[CpuLinear]) -> Path:
    digest = hashlib.sha256(cpu_library.build_digest().encode())
    for linear in linears:
        digest.update(f"{linear.out_features}x{linear.in_features};".encode())
    digest.update(repr(PROBE_ROWS).encode())
    return cpu_library.cache_dir() / f"gemm-plan-{digest.hexdigest()[:16]}.json"


def _publish(path: Path, plan: GemmPlan) -> GemmPlan:
    """Write ``plan`` unless another process wrote one first; return the plan on disk."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, private = tempfile.mkstemp(prefix=path.stem, dir=path.parent)
    try:
        with os.fdopen(handle, "w") as file:
            json.dump({"tile_max_rows": plan.tile_max_rows}, file)
        os.link(private, path)  # fails if the plan exists: the first one written stays
    except FileExistsError:
        stored = _read_plan(path)
        if stored is not None:
            return stored
        os.replace(private, path)  # not a plan: this one takes its place
        return plan
    finally:
        if os.path.exists(private):
            os.unlink(private)
    return plan


def _read_plan(path: Path) -> GemmPlan | None:
    """The plan stored at ``path``; None if there is none or it is not a plan."""
    try:
        limit = json.loads(path.read_text())["tile_max_rows"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if limit is not None and (not isinstance(limit, int) or limit < 0):
        return None
    return GemmPlan(tile_max_rows=limit)


def _probe_plan(linears: list[CpuLinear]) -> GemmPlan:
    """Time both kernels over the model's own linear layers (packed with ``BOTH``), in order,
    at each of ``PROBE_ROWS``, and return the plan of the faster one per row count.

    Real weights matter: one layer's matrices would sit in cache and flatter the kernel that
    reads more bytes. Past the largest probed row count, whichever won there keeps winning;
    below it, rows past the last count the tiles won at run BLAS."""
    tiles_win: list[bool] = []
    for rows in PROBE_ROWS:
        # Each layer in its own dtype: the int8 pool's turns stay float32 in a bf16 model.
        probed = linears if rows <= PROBE_ALL_LINEARS_UP_TO else linears[:PROBE_LINEARS_MANY_ROWS]
        inputs = {
            (size, dtype): torch.randn(rows, size, dtype=dtype)
            for size, dtype in {(linear.in_features, linear.dtype) for linear in probed}
        }

        def run(kernel: str, inputs=inputs, probed=probed) -> None:
            for linear in probed:
                getattr(linear, kernel)(inputs[linear.in_features, linear.dtype])

        tiles_win.append(
            cpu_library.first_is_faster(lambda: run("forward_tiles"), lambda: run("forward_blas"))
        )
    if all(tiles_win):
        return TILES_ONLY
    limit = 0
    for rows, wins in zip(PROBE_ROWS, tiles_win, strict=True):
        if not wins:
            break
        limit = rows
    return GemmPlan(tile_max_rows=limit)
