"""The one-kernel SiLU-and-multiply and RoPE of ``kernels/triton/elementwise.py``, and the RMSNorm
they go in with (``kernels/triton/invariant.py``), against their torch twins
(``common/model/llama.py``): RoPE to the bit, SiLU-and-multiply and RMSNorm to their dtype's
rounding. On a CPU Triton interprets."""

from __future__ import annotations

import pytest
import torch
from engines import build_engine
from tiny_models import assert_greedy_equal_up_to_near_ties, build_tiny_model, random_prompts

import kernels.triton.backend as triton_backend
from common.model.llama import RMSNorm, RotaryApply
from common.model.mlp import SiluAndMul
from common.sampling_params import SamplingParams
from kernels.interface import AttentionBackend
from kernels.layer_kernels import CudaKernels
from kernels.registry import ENV_VAR
from kernels.triton.backend import TritonAttentionBackend
from kernels.triton.elementwise import CudaRotaryApply, CudaSiluAndMul, cuda_ops_apply
from kernels.triton.invariant import InvariantRMSNorm, add_rms_norm
from kernels.triton.store_kv import rotate_and_store_kv

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.bfloat16, torch.float16]


def assert_twins_bits(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal bits; except that Triton's interpreter rounds float32 to bfloat16 towards zero
    (a GPU, and torch, to nearest), so there bf16 may differ by that rounding."""
    if got.dtype == torch.bfloat16 and not torch.cuda.is_available():
        # Two truncations where a sum cancels: within an ulp of the largest value.
        atol = expected.float().abs().max().item() * 2**-7
        torch.testing.assert_close(got, expected, atol=atol, rtol=2**-6)
    else:
        assert torch.equal(got, expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_gives_the_twins_bits_on_strided_q_and_k(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    tokens, heads, kv_heads, head_dim = 7, 4, 2, 64
    # q and k as the attention makes them: views of one qkv buffer.
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, device=DEVICE).to(dtype)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.reshape(tokens, heads, head_dim), k.reshape(tokens, kv_heads, head_dim)
    angles = torch.rand(tokens, head_dim // 2, device=DEVICE) * 100
    angles = torch.cat((angles, angles), dim=-1)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    expected_q, expected_k = RotaryApply()(q.clone(), k.clone(), cos, sin)
    got_q, got_k = CudaRotaryApply()(q, k, cos, sin)
    assert_twins_bits(got_q, expected_q)
    assert_twins_bits(got_k, expected_k)
    assert got_q.data_ptr() == q.data_ptr()  # rotated in place, in the qkv buffer


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("size", [64, 1536])  # one block, and several blocks a row
def test_silu_and_mul_matches_the_twin(dtype: torch.dtype, size: int) -> None:
    torch.manual_seed(1)
    gate_up = (torch.randn(5, 2 * size, device=DEVICE) * 4).to(dtype)
    expected = SiluAndMul()(gate_up)
    got = CudaSiluAndMul()(gate_up)
    # exp is not torch's own (nor, on a GPU, CUDA's expf): its last float32 bit may tip a
    # rounding to 16 bits, twice (SiLU, then the product).
    ulp = 2**-7 if dtype == torch.bfloat16 else 2**-10
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=3 * ulp)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(9, 576), (3, 4, 64)])  # hidden rows, and q_norm's heads
def test_rms_norm_matches_the_twin(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    torch.manual_seed(2)
    twin = RMSNorm(shape[-1], 1e-5).to(DEVICE, dtype)
    with torch.no_grad():
        twin.weight.copy_(torch.rand(shape[-1]) + 0.5)
    x = (torch.randn(*shape, device=DEVICE) * 3).to(dtype)
    expected = twin(x)
    got = InvariantRMSNorm(twin.weight, twin.eps)(x)
    assert got.shape == expected.shape and got.dtype == dtype
    # The sum of squares is added in another order: at most the dtype's last bit, times two
    # for the interpreter's bf16 rounding.
    torch.testing.assert_close(
        got, expected, atol=0, rtol=2**-6 if dtype == torch.bfloat16 else 2**-9
    )


@pytest.mark.parametrize("dtype", [*DTYPES, torch.float32])
@pytest.mark.parametrize("num_rows", [1, 9])
def test_add_rms_norm_gives_the_bits_of_the_add_then_the_norm(
    dtype: torch.dtype, num_rows: int
) -> None:
    """The residual add and the norm after it in one kernel: the sum has torch's add's bits
    and its norm the norm kernel's, also where the delta is a strided view (a slice of a wider
    output) and its rows' sum cancels."""
    torch.manual_seed(3)
    size = 576
    norm = InvariantRMSNorm((torch.rand(size, device=DEVICE) + 0.5).to(dtype), 1e-5)
    hidden = (torch.randn(num_rows, size, device=DEVICE) * 3).to(dtype)
    wider = (torch.randn(num_rows, 2 * size, device=DEVICE) * 3).to(dtype)
    delta = wider[:, size:]
    delta[0, :8] = -hidden[0, :8]  # sums of exactly zero
    total, normed = norm.add_and_norm(hidden, delta)
    expected_total = hidden + delta
    assert total.shape == normed.shape == hidden.shape and total.dtype == normed.dtype == dtype
    assert_twins_bits(total, expected_total)
    assert torch.equal(normed, norm(total))
    assert torch.equal(total[0, :8], torch.zeros(8, dtype=dtype, device=DEVICE))


def test_add_rms_norm_refuses_rows_that_do_not_match() -> None:
    weight = torch.ones(64, device=DEVICE)
    x = torch.randn(3, 64, device=DEVICE)
    with pytest.raises(ValueError, match="one shape and dtype"):
        add_rms_norm(x, torch.randn(2, 64, device=DEVICE), weight, 1e-6)
    with pytest.raises(ValueError, match="one shape and dtype"):
        add_rms_norm(x, x.half(), weight, 1e-6)
    with pytest.raises(ValueError, match="matching weight"):
        add_rms_norm(x, x, torch.ones(32, device=DEVICE), 1e-6)
    empty = torch.empty(0, 64, device=DEVICE)
    assert [t.shape for t in add_rms_norm(empty, empty, weight, 1e-6)] == [(0, 64), (0, 64)]


def test_empty_batches_and_which_models_they_serve() -> None:
    empty = torch.empty(0, 128, device=DEVICE, dtype=torch.bfloat16)
    assert CudaSiluAndMul()(empty).shape == (0, 64)
    assert InvariantRMSNorm(torch.ones(128, dtype=torch.bfloat16, device=DEVICE), 1e-6)(
        empty
    ).shape == (
        0,
        128,
    )
    assert cuda_ops_apply(torch.bfloat16, 128)
    # float32 models keep torch's ops: a GPU would contract RoPE's products into an FMA there,
    # and float32 is the dtype the engine is compared with transformers in.
    assert not cuda_ops_apply(torch.float32, 128)


@pytest.mark.parametrize("family", ["llama3-rope", "qwen3-qknorm"])
def test_a_model_with_them_swapped_in_gives_the_same_greedy_tokens(tmp_path, family) -> None:
    """The engine's own forward with the kernels in its layers (q/k norms included), against
    the same model on torch's ops; float16 (the interpreter's bfloat16 rounds differently).
    Compiled for a GPU, SiLU's exp and the norms' sums may tip a last bit where the
    interpreter's did not: there tokens may part where two logits nearly tie."""
    folder = build_tiny_model(family, tmp_path / family)
    prompts = random_prompts(3, seed=4)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    expected = build_engine(folder, dtype="float16", device=DEVICE, enforce_eager=True).generate(
        prompts, params
    )
    engine = build_engine(folder, dtype="float16", device=DEVICE, enforce_eager=True)
    assert cuda_ops_apply(torch.float16, engine.model.config.head_dim)
    engine.model.use_kernels(CudaKernels())
    assert isinstance(engine.model.layers[0].mlp.act, CudaSiluAndMul)
    got = engine.generate(prompts, params)
    if DEVICE == "cuda":
        assert_greedy_equal_up_to_near_ties(folder, prompts, got, expected)
    else:
        assert got == expected


def test_the_triton_backend_rotates_and_stores_in_one_launch_with_the_same_tokens(
    tmp_path, monkeypatch
) -> None:
    """With the kernels swapped in, the Triton backend's store rotates the queries and keys
    (one launch a layer for RoPE and the store): the same greedy tokens as RoPE's own kernel
    then the plain store, on FP8 pages (every page format's bits: test_kernels.py)."""
    folder = build_tiny_model("llama3-rope", tmp_path / "model")
    prompts = random_prompts(3, seed=5)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)

    def greedy_tokens() -> list[list[int]]:
        engine = build_engine(
            folder,
            dtype="float16",
            device=DEVICE,
            enforce_eager=True,
            kv_cache_dtype="fp8",
        )
        engine.model.use_kernels(CudaKernels())
        return engine.generate(prompts, params)

    monkeypatch.setenv(ENV_VAR, "triton")
    launches: list[int] = []

    def counted(*args) -> None:
        launches.append(1)
        rotate_and_store_kv(*args)

    monkeypatch.setattr(triton_backend, "rotate_and_store_kv", counted)
    fused = greedy_tokens()
    assert launches
    with monkeypatch.context() as patch:
        patch.setattr(
            TritonAttentionBackend, "rotate_and_store_kv", AttentionBackend.rotate_and_store_kv
        )
        launches.clear()
        assert greedy_tokens() == fused
        assert not launches
