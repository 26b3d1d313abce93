"""Deterministic inference in one process: a request's tokens and logprobs are the same bits
alone or in a batch, under any chunk budget, with the prefix cache warm, cold or off, and with
speculation on or off; without the flag the same matrix shows a difference (so the flag is what
makes them equal).

The cluster-level half (P/D vs one process, ZeroMQ vs NIXL, several workers, 32 concurrent
requests) is in ``test_deterministic_cluster.py``.
"""

from __future__ import annotations

import pytest
import torch
from determinism import (
    alone_and_batched_in_small_steps,
    assert_answers_are_invariant,
    sampling_params,
    serve,
)
from engines import build_engine
from tiny_models import build_tiny_model

from common.model.default_model import ensure_default_model
from kernels.cpu import library as cpu_library

pytestmark = pytest.mark.skipif(not cpu_library.available(), reason="needs the C kernels")


@pytest.fixture(scope="module", params=["qwen2-bias", "qwen3-qknorm"])
def tiny_folder(request, tmp_path_factory):
    return build_tiny_model(request.param, tmp_path_factory.mktemp(request.param))


@pytest.mark.parametrize(
    "dtype, kv",
    [("bfloat16", "auto"), ("float32", "auto"), ("bfloat16", "int8")],
    ids=["bfloat16", "float32", "bfloat16-kv=int8"],
)
def test_answers_do_not_depend_on_batch_chunks_cache_or_speculation(tiny_folder, dtype, kv):
    assert_answers_are_invariant(tiny_folder, dtype=dtype, kv_cache_dtype=kv)


def test_without_the_flag_the_same_matrix_differs(tiny_folder) -> None:
    """The control: the default kernels block their sums by the shape of the step, so at least
    one logprob of the same requests changes between one at a time and batched in small
    chunks. (In bf16 a model this small rounds most such differences away; the SmolLM2 test
    below has the bf16 control.)"""
    alone, batched = alone_and_batched_in_small_steps(tiny_folder)
    assert batched != alone


@pytest.mark.slow
def test_smollm2_answers_do_not_depend_on_batch_chunks_or_cache() -> None:
    """The default model in bf16, its real shapes: 30 layers, 9 query and 3 KV heads."""
    folder = ensure_default_model(progress=False)
    generator = torch.Generator().manual_seed(11)
    prompts = [torch.randint(100, 40000, (n,), generator=generator).tolist() for n in (40, 75)]
    prompts.append([*prompts[1][:64], 17, 18])  # a four-page cache hit once prompt 1 ran
    params = sampling_params(len(prompts))
    engine = build_engine(folder, dtype="bfloat16", deterministic=True)
    cached: list[int] = []
    alone = serve(engine, prompts, params, together=False, cached_tokens=cached)
    assert cached[2] == 64
    assert serve(engine, prompts, params, together=True) == alone
    small_steps = {"max_num_batched_tokens": 24, "prefix_caching": False}
    chunked = build_engine(folder, dtype="bfloat16", deterministic=True, **small_steps)
    assert serve(chunked, prompts, params, together=True) == alone
    # The control, without the flag.
    default = build_engine(folder, dtype="bfloat16", deterministic=False)
    alone = serve(default, prompts, params, together=False)
    chunked = build_engine(folder, dtype="bfloat16", deterministic=False, **small_steps)
    assert serve(chunked, prompts, params, together=True) != alone
