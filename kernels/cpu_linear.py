"""Linear layers on the CPU: weights stored the way this machine's fastest GEMMs want them.

Two kernels compete, and which is faster depends on the processor and on the row count:

- **bf16 tiles** (``kernels/cpu/linear_bf16.c``): the bf16 weight prepacked into tiles of 32
  output columns, each one sequential stream, widened to float32 as it is read. A decode step
  is a stream over the weights, and this one reads half the bytes of fp32 at memory speed;
- **fp32** (MKL): the weight widened once to float32 and stored transposed (``[in, out]``), the
  layout MKL runs fastest. With many rows (prefill) it can beat the tiles' FMA loop.

Both multiply exactly (a bf16 value widened to float32 is exact), sum in float32 and round the
output to the model's dtype once, so the choice changes the summation order, not the
computation: a bf16 model's hidden states are bf16 either way. ``choose_gemm_plan`` times both
over the model's own weights at start-up and picks, per row count, the faster; only the forms
the chosen plan uses are kept in memory.

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

logger = logging.getLogger(__name__)

# Row counts the probe times: decode batches and verification runs, then prefill-sized chunks.
PROBE_ROWS = (1, 8, 32, 128)
# Output columns per prepacked tile; must match TILE in kernels/cpu/linear_bf16.c.
TILE = 32


@dataclass(frozen=True, slots=True)
class GemmPlan:
    """Rows up to ``bf16_max_rows`` run the bf16 tile kernel, the rest fp32.

    ``bf16_max_rows`` is 0 when the tiles are never used and None when they always are."""

    bf16_max_rows: int | None

    @property
    def uses_bf16(self) -> bool:
        return self.bf16_max_rows is None or self.bf16_max_rows > 0

    @property
    def uses_fp32(self) -> bool:
        return self.bf16_max_rows is not None

    def describe(self) -> str:
        if not self.uses_fp32:
            return "bf16 tile GEMMs at every row count"
        if not self.uses_bf16:
            return "fp32 GEMMs at every row count"
        return f"bf16 tile GEMMs up to {self.bf16_max_rows} rows, fp32 beyond"


class StepShape:
    """What every ``CpuLinear`` of one model knows about the step it runs in (set once per
    forward by the model).

    A step of decode and verification runs only (``short_runs_only``) takes the bf16 tiles at
    any row count: they sum each row in the same order whatever the row count, so a sequence's
    tokens do not depend on how many rows share its step, and speculation, which adds rows,
    changes no token. Steps with prefill chunks take the plan's kernel for their row count."""

    __slots__ = ("short_runs_only",)

    def __init__(self) -> None:
        self.short_runs_only = False


FP32_ONLY = GemmPlan(bf16_max_rows=0)
BF16_ONLY = GemmPlan(bf16_max_rows=None)
BOTH = GemmPlan(bf16_max_rows=PROBE_ROWS[-1])


def pack_bf16_tiles(weight: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` -> ``[ceil(N / TILE), K, TILE]`` contiguous, columns past N zero."""
    out_features, in_features = weight.shape
    padded = -(-out_features // TILE) * TILE
    transposed = F.pad(weight.detach().t(), (0, padded - out_features))
    return transposed.reshape(in_features, padded // TILE, TILE).permute(1, 0, 2).contiguous()


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
        self.plan = plan
        self.step = step or StepShape()
        self.packed_bf16 = None
        self.bias_bf16 = None
        if plan.uses_bf16:
            self.packed_bf16 = pack_bf16_tiles(weight)
            self.bias_bf16 = None if bias is None else bias.detach().to(torch.float32)
        self.weight_t32 = None
        self.bias32 = None
        if plan.uses_fp32:
            self.weight_t32 = weight.detach().to(torch.float32).t().contiguous()
            self.bias32 = None if bias is None else bias.detach().to(torch.float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        limit = self.plan.bf16_max_rows
        if self.packed_bf16 is not None and (
            limit is None or x.shape[0] <= limit or self.step.short_runs_only
        ):
            return self.forward_bf16(x)
        return self.forward_fp32(x)

    def forward_bf16(self, x: torch.Tensor) -> torch.Tensor:
        if x.stride(-1) != 1:
            x = x.contiguous()
        out = torch.empty((x.shape[0], self.out_features), dtype=torch.bfloat16)
        status = cpu_library.load().pdserve_linear_bf16(
            x.data_ptr(),
            x.stride(0),
            self.packed_bf16.data_ptr(),
            None if self.bias_bf16 is None else self.bias_bf16.data_ptr(),
            out.data_ptr(),
            out.stride(0),
            x.shape[0],
            self.out_features,
            self.in_features,
            torch.get_num_threads(),
        )
        if status != 0:
            raise MemoryError("the bf16 GEMM kernel could not allocate its scratch memory")
        return out

    def forward_fp32(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.to(torch.float32)
        if self.bias32 is None:
            out = torch.mm(x32, self.weight_t32)
        else:
            out = torch.addmm(self.bias32, x32, self.weight_t32)
        return out.to(self.dtype)

    def restrict(self, plan: GemmPlan) -> None:
        """Switch to ``plan`` (which may use fewer kernels) and drop the forms it does not use."""
        if plan.uses_bf16 and self.packed_bf16 is None:
            raise ValueError("this layer holds no prepacked bf16 weight")
        if plan.uses_fp32 and self.weight_t32 is None:
            raise ValueError("this layer holds no fp32 weight")
        self.plan = plan
        if not plan.uses_bf16:
            self.packed_bf16 = self.bias_bf16 = None
        if not plan.uses_fp32:
            self.weight_t32 = self.bias32 = None

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, {self.plan.describe()}"


# Both forms of every weight are held while the probe runs; past this many bytes of fp32
# weights that is too much memory to spend, and such a model runs the bf16 tiles only.
PROBE_MAX_FP32_BYTES = 4 << 30


def probe_plan(dtype: torch.dtype, num_params: int) -> GemmPlan:
    """The plan to pack with before ``choose_gemm_plan``: both kernels where a probe will
    choose between them, else the one kernel there is to use."""
    if dtype != torch.bfloat16 or not cpu_library.available():
        return FP32_ONLY
    if num_params * 4 > PROBE_MAX_FP32_BYTES:
        return BF16_ONLY
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
            json.dump({"bf16_max_rows": plan.bf16_max_rows}, file)
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
        limit = json.loads(path.read_text())["bf16_max_rows"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if limit is not None and (not isinstance(limit, int) or limit < 0):
        return None
    return GemmPlan(bf16_max_rows=limit)


def _probe_plan(linears: list[CpuLinear]) -> GemmPlan:
    """Time both kernels over the model's own linear layers (packed with ``BOTH``), in order,
    at each of ``PROBE_ROWS``, and return the plan of the faster one per row count.

    Real weights matter: one layer's matrices would sit in cache and flatter the kernel that
    reads more bytes. Past the largest probed row count, whichever won there keeps winning:
    more rows only make the GEMM more compute-bound."""
    bf16_wins: list[bool] = []
    for rows in PROBE_ROWS:
        inputs = {
            size: torch.randn(rows, size, dtype=torch.bfloat16)
            for size in {linear.in_features for linear in linears}
        }

        def run(kernel: str, inputs=inputs) -> None:
            for linear in linears:
                getattr(linear, kernel)(inputs[linear.in_features])

        bf16_wins.append(
            cpu_library.best_seconds(lambda: run("forward_bf16"))
            <= cpu_library.best_seconds(lambda: run("forward_fp32"))
        )
    if all(bf16_wins):
        return GemmPlan(bf16_max_rows=None)
    limit = 0
    for rows, wins in zip(PROBE_ROWS, bf16_wins, strict=True):
        if not wins:
            break
        limit = rows
    return GemmPlan(bf16_max_rows=limit)
