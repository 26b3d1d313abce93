"""Quantized weights as every kernel reads them, whatever checkpoint format they came from.

Every format pdserve loads (compressed-tensors' FP8, int8 and packed 4-bit; GGUF's Q8_0, Q4_0,
Q4_1, Q4_K and Q6_K) is one case of the same arithmetic, with no loss in the translation:

    w[n, k] = scales[n, k // group_size] * code[n, k] - offsets[n, k // group_size]

where a code is an int8 (``INT8``), an unsigned 4-bit value (``UINT4``) or an FP8 e4m3 value
(``FP8_E4M3``), and groups run along the input dimension (the last group may be short). A
per-tensor or per-channel scale is a group as wide as the row; a block scale (DeepSeek's [128,
128]) is repeated over the block's rows. Offsets are None where the format is symmetric. So the
kernels are one per code kind, and the loaders' only job is to say which codes and scales a
checkpoint holds (``common/model/quantization/``).

``QuantizedWeight.dequantize`` is the torch twin every kernel is tested against: the scale
times the code, less the offset, in float32. For the formats read here that product is exact
in float32 (16-bit scales times codes of at most 8 bits), so the twin is the checkpoint's own
dequantized weight.

Activations: W8A8 checkpoints quantize each linear layer's input too, per token (dynamic) or
with one scale learnt at calibration (static). ``ActivationQuantization.apply`` rounds the
input as the checkpoint's own kernels would and returns it dequantized, so every GEMM after it
multiplies the values the checkpoint was calibrated for.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from kernels.sizes import ceil_div

INT8 = "int8"
UINT4 = "uint4"
FP8_E4M3 = "fp8_e4m3"
CODE_KINDS = (INT8, UINT4, FP8_E4M3)
# The largest magnitude of each kind of activation code.
FP8_E4M3_MAX = 448.0
INT8_MAX = 127.0
# The magnitude a dynamic int8 scale maps a row's largest input to: half the code range
# (127 - -128) / 2, as compressed-tensors computes it (vLLM's int8 kernels take 127; the two
# differ by 0.4% in the scale, compressed-tensors' is the checkpoint's own).
INT8_SCALE_RANGE = 127.5


@dataclass(frozen=True, slots=True)
class QuantizedWeight:
    """A linear layer's ``[out_features, in_features]`` weight as codes, scales and offsets.

    ``codes``: ``INT8``: int8 ``[N, K]``; ``FP8_E4M3``: uint8 ``[N, K]``, the e4m3fn bits;
    ``UINT4``: uint8 ``[N, ceil(K / 2)]``, input column 2j in the low nibble of byte j and
    2j + 1 in its high nibble. ``scales`` and ``offsets``: float32 ``[N, ceil(K / group_size)]``.
    """

    kind: str
    codes: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor | None
    group_size: int
    in_features: int

    def __post_init__(self) -> None:
        if self.kind not in CODE_KINDS:
            raise ValueError(f"unknown code kind {self.kind!r}; pdserve reads {CODE_KINDS}")
        rows = self.codes.shape[0]
        width = ceil_div(self.in_features, 2) if self.kind == UINT4 else self.in_features
        code_dtype = torch.int8 if self.kind == INT8 else torch.uint8
        if self.codes.dim() != 2 or self.codes.shape[1] != width or self.codes.dtype != code_dtype:
            raise ValueError(
                f"{self.kind} codes of a [{rows}, {self.in_features}] weight must be "
                f"{code_dtype} [{rows}, {width}], got {self.codes.dtype} {tuple(self.codes.shape)}"
            )
        groups = (rows, ceil_div(self.in_features, self.group_size))
        for name, tensor in (("scales", self.scales), ("offsets", self.offsets)):
            if tensor is None:
                continue
            if tuple(tensor.shape) != groups or tensor.dtype != torch.float32:
                raise ValueError(
                    f"{name} of a [{rows}, {self.in_features}] weight in groups of "
                    f"{self.group_size} must be float32 {groups}, got {tensor.dtype} "
                    f"{tuple(tensor.shape)}"
                )

    @property
    def out_features(self) -> int:
        return self.codes.shape[0]

    @property
    def shape(self) -> tuple[int, int]:
        return self.out_features, self.in_features

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def code_values(self) -> torch.Tensor:
        """``[N, K]`` float32: each code's value (before its scale)."""
        if self.kind == INT8:
            return self.codes.float()
        if self.kind == FP8_E4M3:
            return self.codes.view(torch.float8_e4m3fn).float()
        low, high = self.codes & 0x0F, self.codes >> 4
        values = torch.stack((low, high), dim=-1).flatten(1)[:, : self.in_features]
        return values.float()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The ``[N, K]`` weight this stands for (the torch twin of every kernel)."""
        scales = self.scales.repeat_interleave(self.group_size, dim=1)[:, : self.in_features]
        weight = self.code_values() * scales
        if self.offsets is not None:
            offsets = self.offsets.repeat_interleave(self.group_size, dim=1)
            weight = weight - offsets[:, : self.in_features]
        return weight.to(dtype)

    def rows(self, start: int, stop: int) -> QuantizedWeight:
        """Output rows ``start:stop`` (a column-parallel rank's slice)."""
        offsets = None if self.offsets is None else self.offsets[start:stop]
        return replace(
            self, codes=self.codes[start:stop], scales=self.scales[start:stop], offsets=offsets
        )

    def columns(self, start: int, stop: int) -> QuantizedWeight:
        """Input columns ``start:stop`` (a row-parallel rank's slice). A group never straddles
        two ranks: ``start`` must begin a group and ``stop`` end one (or the row)."""
        if start % self.group_size or (stop % self.group_size and stop != self.in_features):
            raise ValueError(
                f"input columns {start}:{stop} split a group of {self.group_size}; a rank's "
                "slice of a quantized weight must hold whole groups"
            )
        if self.kind == UINT4 and start % 2:
            raise ValueError("a slice of 4-bit codes must start on an even column")
        code_start, code_stop = (
            (start // 2, ceil_div(stop, 2)) if self.kind == UINT4 else (start, stop)
        )
        first, last = start // self.group_size, ceil_div(stop, self.group_size)
        offsets = None if self.offsets is None else self.offsets[:, first:last]
        return replace(
            self,
            codes=self.codes[:, code_start:code_stop],
            scales=self.scales[:, first:last],
            offsets=offsets,
            in_features=stop - start,
        )

    def to(self, device: torch.device) -> QuantizedWeight:
        offsets = None if self.offsets is None else self.offsets.to(device)
        return replace(
            self, codes=self.codes.to(device), scales=self.scales.to(device), offsets=offsets
        )

    def nbytes(self) -> int:
        """Bytes the weight occupies: what a GEMM over it reads."""
        extra = 0 if self.offsets is None else self.offsets.nbytes
        return self.codes.nbytes + self.scales.nbytes + extra


def cat_rows(parts: Sequence[QuantizedWeight]) -> QuantizedWeight:
    """One weight of ``parts``' rows in order (q, k and v fused into one projection). The
    parts must agree on kind, width and groups; offsets are zero where a part has none."""
    first = parts[0]
    for part in parts[1:]:
        if (part.kind, part.in_features, part.group_size) != (
            first.kind,
            first.in_features,
            first.group_size,
        ):
            raise ValueError(
                "weights fused into one projection must share their quantization: "
                f"{first.kind} in groups of {first.group_size} vs {part.kind} in groups of "
                f"{part.group_size}"
            )
    offsets = None
    if any(part.offsets is not None for part in parts):
        offsets = torch.cat(
            [
                torch.zeros_like(part.scales) if part.offsets is None else part.offsets
                for part in parts
            ]
        )
    return replace(
        first,
        codes=torch.cat([part.codes for part in parts]),
        scales=torch.cat([part.scales for part in parts]),
        offsets=offsets,
    )


# Where the activation scale comes from.
DYNAMIC_PER_TOKEN = "dynamic_per_token"
# A scale per token and group of ``group_size`` inputs (block FP8 checkpoints: groups of 128).
DYNAMIC_PER_TOKEN_GROUP = "dynamic_per_token_group"
DYNAMIC_PER_TENSOR = "dynamic_per_tensor"
STATIC = "static"
ACTIVATION_STRATEGIES = (DYNAMIC_PER_TOKEN, DYNAMIC_PER_TOKEN_GROUP, DYNAMIC_PER_TENSOR, STATIC)


@dataclass(frozen=True, slots=True)
class ActivationQuantization:
    """How a W8A8 checkpoint rounds a linear layer's input: to ``kind`` (``INT8`` or
    ``FP8_E4M3``, symmetric), with a scale per token, per token and group of ``group_size``
    inputs, per tensor, or ``static_scale``."""

    kind: str
    strategy: str
    static_scale: float | None = None
    group_size: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in (INT8, FP8_E4M3):
            raise ValueError(f"activations are quantized to int8 or FP8 e4m3, not {self.kind}")
        if self.strategy not in ACTIVATION_STRATEGIES:
            raise ValueError(f"unknown activation scale strategy {self.strategy!r}")
        if (self.strategy == DYNAMIC_PER_TOKEN_GROUP) != (self.group_size is not None):
            raise ValueError("a group size goes with per-token-group scales, and only with them")
        if self.group_size is not None and self.group_size <= 0:
            raise ValueError(f"an activation group size must be positive, got {self.group_size}")
        if (self.strategy == STATIC) != (self.static_scale is not None):
            raise ValueError("a static activation scale, and only it, needs its value")
        if self.static_scale is not None and not self.static_scale > 0:
            raise ValueError(f"an activation scale must be positive, got {self.static_scale}")

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` rounded to the checkpoint's activation codes, back in ``x``'s dtype."""
        limit = FP8_E4M3_MAX if self.kind == FP8_E4M3 else INT8_MAX
        scale_range = FP8_E4M3_MAX if self.kind == FP8_E4M3 else INT8_SCALE_RANGE
        x32 = x.float()
        if self.strategy == DYNAMIC_PER_TOKEN_GROUP:
            assert self.group_size is not None
            width = x32.shape[-1]
            padded = F.pad(x32, (0, ceil_div(width, self.group_size) * self.group_size - width))
            grouped = padded.unflatten(-1, (-1, self.group_size))
            per_token = ActivationQuantization(self.kind, DYNAMIC_PER_TOKEN)
            rounded = per_token.apply(grouped).flatten(-2)[..., :width]
            return rounded.to(x.dtype)
        if self.strategy == STATIC:
            scale = torch.tensor(self.static_scale, dtype=torch.float32, device=x.device)
        elif self.strategy == DYNAMIC_PER_TOKEN:
            scale = x32.abs().amax(dim=-1, keepdim=True) / scale_range
        else:
            scale = x32.abs().amax() / scale_range
        # An all-zero row has scale 0: it stays zero.
        scale = torch.clamp(scale, min=torch.finfo(torch.float32).tiny)
        scaled = x32 / scale
        if self.kind == FP8_E4M3:
            codes = scaled.clamp(-limit, limit).to(torch.float8_e4m3fn).float()
        else:
            # The code range is one wider below: a row's most negative input, at -127.5
            # scales, rounds (to even) to -128.
            codes = torch.round(scaled.clamp(-limit - 1, limit))
        return (codes * scale).to(x.dtype)


class QuantizedLinear(nn.Module):
    """``y = q(x) W^T + b``: ``W`` held as codes and scales, ``q`` the checkpoint's rounding of
    the input (W8A8) or nothing (weight-only formats). The twin the device's kernels stand in
    for (``LayerKernels.quantized_linear``), and what runs where a device has none: the weight
    dequantized at each call, then torch's GEMM."""

    def __init__(
        self,
        weight: QuantizedWeight,
        bias: torch.Tensor | None,
        activations: ActivationQuantization | None,
        dtype: torch.dtype,
    ) -> None:
        """``dtype``: the model's, which its inputs and outputs are in."""
        super().__init__()
        self.qweight = weight
        self.compute_dtype = dtype
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.activations = activations
        self.in_features, self.out_features = weight.in_features, weight.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.activations is not None:
            x = self.activations.apply(x)
        return F.linear(x, self.qweight.dequantize(x.dtype), self.bias)

    def extra_repr(self) -> str:
        rounding = "" if self.activations is None else f", inputs {self.activations.kind}"
        return (
            f"in={self.in_features}, out={self.out_features}, {self.qweight.kind} codes in "
            f"groups of {self.qweight.group_size}{rounding}"
        )


class RoundedInputs(nn.Module):
    """``linear(q(x))``: a W8A8 layer's input rounding in front of a dense twin of its weight
    (``LayerKernels`` that multiply a dequantized copy, as the batch-invariant ones do)."""

    def __init__(self, activations: ActivationQuantization, linear: nn.Module) -> None:
        super().__init__()
        self.activations = activations
        self.linear = linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(self.activations.apply(x))
