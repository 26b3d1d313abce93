"""The whole engine on the Triton backend gives the torch backend's greedy tokens.

Without CUDA the kernels run in Triton's interpreter (tests/conftest.py), in float32: the
interpreter's `tl.dot` is wrong on bf16 operands in Triton 3.9. On CUDA the same check runs on
the compiled kernels, bf16 included.
"""

from __future__ import annotations

import os

import pytest
import torch
from engines import build_engine
from tiny_models import assert_greedy_equal_up_to_near_ties, build_tiny_model, random_prompts
from triton_variants import compiled_on_gpu, new_variants, record_variants

from common.config import SpeculativeConfig
from common.engine.batch import HostStaging
from common.sampling_params import SamplingParams
from kernels.registry import ENV_VAR


def greedy_on_both_backends(folder, monkeypatch, **knobs):
    """The prompts, then the greedy tokens of the torch backend's engine and of the Triton
    backend's, both built with ``knobs``."""
    prompts = random_prompts(3, seed=7, min_len=10, max_len=30)
    params = SamplingParams(max_tokens=10, temperature=0.0)
    tokens = []
    for backend in ("torch", "triton"):
        monkeypatch.setenv(ENV_VAR, backend)
        engine = build_engine(
            folder,
            num_pages=64,
            # Small chunks make steps that mix prefill chunks over cached prefixes with decodes.
            max_num_batched_tokens=24,
            max_model_len=256,
            **knobs,
        )
        assert engine.backend.name == backend
        tokens.append(engine.generate(prompts, params))
    return prompts, *tokens


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton reads CPU tensors only in its interpreter; on CUDA the compiled test runs",
)
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8", "int8"])
def test_triton_backend_matches_torch_backend(tmp_path, monkeypatch, kv_cache_dtype):
    folder = build_tiny_model("qwen3-qknorm", tmp_path / "model")
    _, expected, got = greedy_on_both_backends(folder, monkeypatch, kv_cache_dtype=kv_cache_dtype)
    assert got == expected


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.parametrize(
    "dtype, kv_cache_dtype",
    [
        ("float32", "auto"),
        ("float32", "fp8"),
        ("float32", "int8"),
        ("bfloat16", "auto"),
        ("bfloat16", "int8"),
    ],
)
def test_compiled_triton_backend_matches_torch_backend_on_cuda(
    tmp_path, monkeypatch, dtype, kv_cache_dtype
):
    """The kernels compiled for the GPU, not interpreted. In float32 both backends compute in
    IEEE float32 (no TF32) and give the same tokens; in bf16 they round at the same points but
    sum in different orders, so tokens may part only where two logits nearly tie."""
    folder = build_tiny_model("qwen3-qknorm", tmp_path / "model")
    prompts, expected, got = greedy_on_both_backends(
        folder, monkeypatch, device="cuda", dtype=dtype, kv_cache_dtype=kv_cache_dtype
    )
    if dtype == "float32":
        assert got == expected
    else:
        assert_greedy_equal_up_to_near_ties(folder, prompts, got, expected)


def stage_as_on_cuda(monkeypatch) -> None:
    """The Triton backend, and a step's tables reaching its kernels as they do on CUDA: as
    views of one staged buffer."""
    monkeypatch.setenv(ENV_VAR, "triton")
    monkeypatch.setattr(
        HostStaging,
        "to_device",
        lambda staging, arrays, device: staging.through_one_buffer(arrays, device, pinned=False),
    )


def first_tokens_of_every_kind(engine) -> int:
    """First tokens for batches of one to six prompts of one token to four chunks of 64, with
    page tables 1, 16 and other counts of pages wide (a start-up's are 4), then for a prompt
    over the last batch's cached first prompt: a query shorter than its sequence. Returns how
    many of that one's tokens the cache served."""
    first_token = SamplingParams(max_tokens=1, temperature=0.0)
    for seed, lengths in enumerate([[1], [5], [17, 5], [250], [3, 40, 9, 64, 2, 33], [90, 16]]):
        prompts = [
            random_prompts(1, seed=100 * seed + i, min_len=n, max_len=n)[0]
            for i, n in enumerate(lengths)
        ]
        engine.generate(prompts, first_token)
    over_prefix = engine.add_request(prompts[0] + [5, 6, 7], first_token)
    cached = []
    while engine.has_unfinished:
        outputs = engine.step()
        cached += [out.num_cached_tokens for out in outputs if out.request_id == over_prefix]
    return cached[0]


compiled_variants_worked_out = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="works out compiled variants in Triton's interpreter; on CUDA the compiled twin "
    "counts them",
)


@pytest.mark.slow
@compiled_variants_worked_out
def test_a_prefill_worker_compiles_at_start_up_every_kernel_variant_its_requests_run(
    tmp_path, monkeypatch
):
    """A launch that needs a variant of a Triton kernel not compiled yet compiles it there, in
    front of the request (on an H100, W1's TTFT p99 was 1.8 s against a p50 of 70 ms on a
    fresh machine). The prefill worker's start-up forwards must leave nothing to compile: after
    them, first tokens of every kind (``first_tokens_of_every_kind``) launch no variant they
    did not. The step's tables reach the kernels as they do on CUDA, as views of one staged
    buffer."""
    folder = build_tiny_model("qwen2-bias", tmp_path / "model")  # heads of 32, groups of 3
    stage_as_on_cuda(monkeypatch)
    with record_variants() as at_start_up:
        engine = build_engine(
            folder,
            role="prefill",
            num_pages=None,  # planned, after the start-up forward, as on a GPU
            kv_cache_memory=4 << 20,
            max_num_batched_tokens=64,
            max_model_len=256,
        )
    assert engine.backend.name == "triton"
    assert "_prefill_kernel" in at_start_up and "_store_kv_kernel" in at_start_up

    with record_variants() as serving:
        assert first_tokens_of_every_kind(engine) >= 16
    assert new_variants(at_start_up, serving) == {}


@pytest.mark.slow
@compiled_variants_worked_out
def test_a_speculating_engine_compiles_its_drafts_kernel_variants_at_start_up(
    tmp_path, monkeypatch
):
    """A draft of another shape (heads of 64, one KV head, against the target's 32 and two)
    launches variants of its own: its start-up forwards compile them too, so the first steps
    that speculate, and the decodes between, compile nothing."""
    target = build_tiny_model("qwen2-bias", tmp_path / "target")
    draft = build_tiny_model("qwen3-qknorm", tmp_path / "draft", seed=1)
    stage_as_on_cuda(monkeypatch)
    with record_variants() as at_start_up:
        engine = build_engine(
            target,
            num_pages=None,
            kv_cache_memory=4 << 20,
            max_num_batched_tokens=64,
            max_model_len=256,
            speculative=SpeculativeConfig(method="draft", model=str(draft)),
        )
    with record_variants() as serving:
        prompts = random_prompts(3, seed=5, min_len=20, max_len=70)
        engine.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0))
    assert engine.speculator is not None
    head_dims = {dict(key)["HEAD_DIM"] for key, _ in serving["_decode_kernel"]}
    head_dims |= {dict(key)["HEAD_DIM"] for key, _ in serving["_prefill_kernel"]}
    assert head_dims == {32, 64}, "the draft's kernels ran, beside the target's"
    assert new_variants(at_start_up, serving) == {}


@pytest.mark.slow
@pytest.mark.gpu
def test_on_cuda_a_prefill_workers_requests_compile_no_kernel(tmp_path, monkeypatch):
    """The compiled twin of the prefill worker's test above: Triton's own caches on the GPU
    count every kernel's variants, in bf16, so that the one-kernel norms (with the residual
    adds), RoPE and SiLU-and-multiply are counted too. None grows after the start-up. (RoPE
    rides in the KV store's launch here; its own kernel runs only for a model whose KV heads
    are turned, and is counted in case it runs.)"""
    from kernels.triton.decode_attention import _combine_splits_kernel, _decode_kernel
    from kernels.triton.elementwise import _rope_kernel, _silu_and_mul_kernel
    from kernels.triton.invariant import _add_rms_norm_kernel, _rms_norm_kernel
    from kernels.triton.prefill_attention import _prefill_kernel
    from kernels.triton.store_kv import _store_kv_kernel

    kernels = (_prefill_kernel, _decode_kernel, _combine_splits_kernel, _store_kv_kernel)
    kernels += (_rms_norm_kernel, _add_rms_norm_kernel, _rope_kernel, _silu_and_mul_kernel)
    folder = build_tiny_model("qwen2-bias", tmp_path / "model")
    monkeypatch.setenv(ENV_VAR, "triton")
    engine = build_engine(
        folder,
        device="cuda",
        dtype="bfloat16",
        role="prefill",
        num_pages=None,
        kv_cache_memory=64 << 20,
        max_num_batched_tokens=64,
        max_model_len=256,
    )
    at_start_up = {kernel.fn.__name__: compiled_on_gpu(kernel) for kernel in kernels}
    assert at_start_up["_prefill_kernel"] >= 1 and at_start_up["_store_kv_kernel"] >= 1
    assert first_tokens_of_every_kind(engine) >= 16
    torch.cuda.synchronize()
    assert {kernel.fn.__name__: compiled_on_gpu(kernel) for kernel in kernels} == at_start_up
