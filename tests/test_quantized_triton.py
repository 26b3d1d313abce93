"""The Triton GEMM over quantized codes (``kernels/triton/quantized_gemm.py``) against its twin,
the weight dequantized then ``F.linear``: in Triton's interpreter on a CPU (float32 and fp16,
whose ``tl.dot`` the interpreter computes right), compiled where a GPU is (bf16 too)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.quantized import FP8_E4M3, INT8, UINT4, QuantizedLinear, QuantizedWeight
from kernels.triton.quantized_gemm import TritonQuantizedLinear, quantized_linear

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
N, K = 70, 96  # N past one 64-column tile, K past one 64-deep step; groups may end short


def _weight(kind: str, group: int, offsets: bool, seed: int = 0) -> QuantizedWeight:
    generator = torch.Generator().manual_seed(seed)
    if kind == INT8:
        codes = torch.randint(-128, 128, (N, K), dtype=torch.int8, generator=generator)
    elif kind == UINT4:
        codes = torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, generator=generator)
    else:  # every e4m3 value but NaN, subnormals included
        codes = torch.randint(0, 256, (N, K), dtype=torch.uint8, generator=generator)
        codes[(codes & 0x7F) == 0x7F] = 0x3C
    groups = -(-K // group)
    scales = torch.rand(N, groups, generator=generator) * 0.05
    shifts = torch.rand(N, groups, generator=generator) * 0.1 if offsets else None
    return QuantizedWeight(kind, codes, scales, shifts, group, K).to(torch.device(DEVICE))


CASES = [(kind, group, offsets) for kind in (INT8, UINT4, FP8_E4M3) for group, offsets in
         ((32, True), (64, False), (K, False))]  # fmt: skip
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("kind", "group", "offsets"), CASES)
def test_quantized_gemm_equals_its_twin(kind, group, offsets, dtype):
    weight = _weight(kind, group, offsets)
    layer = QuantizedLinear(weight, None, None, dtype)
    bias = torch.randn(N, device=DEVICE).to(dtype)
    for rows in (1, 5, 20):  # a decode tile, and a prefill chunk's 64-row tiles
        x = torch.randn(rows, K, device=DEVICE).to(dtype)
        got = quantized_linear(x, layer, bias).float()
        # The twin rounds the dequantized weight to x's dtype, as the kernel multiplies it.
        expected = F.linear(x.float(), weight.dequantize(dtype).float(), bias.float())
        tolerance = 1e-4 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance * 4)


def test_fp8_codes_decode_exactly():
    """A 1-row identity input reads each e4m3 code of a column back, exactly, in float32."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0  # NaN
    weight = QuantizedWeight(
        FP8_E4M3, codes[None].to(DEVICE), torch.ones(1, 1, device=DEVICE), None, 256, 256
    )
    layer = QuantizedLinear(weight, None, None, torch.float32)
    eye = torch.eye(256, device=DEVICE)
    got = quantized_linear(eye, layer)[:, 0]
    assert torch.equal(got.cpu(), codes.view(torch.float8_e4m3fn).float())


def test_the_module_rounds_inputs_as_its_checkpoint_does():
    from kernels.quantized import DYNAMIC_PER_TOKEN, ActivationQuantization

    weight = _weight(INT8, 32, False)
    rounding = ActivationQuantization(INT8, DYNAMIC_PER_TOKEN)
    twin = QuantizedLinear(weight, None, rounding, torch.float32)
    x = torch.randn(3, K, device=DEVICE)
    torch.testing.assert_close(TritonQuantizedLinear(twin)(x), twin(x), rtol=1e-4, atol=1e-4)
