"""Deterministic inference on the Triton path (the GPU's): the batch-invariant Triton linear
layers and norms (``kernels/triton/invariant.py``) and the attention backend's one-kernel mode
give a request the same bits alone or batched, under any chunk budget, with the prefix cache
warm or off, with speculation on or off; without the flag the same requests differ.

Without CUDA the kernels run in Triton's interpreter (tests/conftest.py), where ``tl.dot`` is
numpy's BLAS matmul: its edge kernels round a row differently by where the row sits in the tile,
which no GPU's tensor cores do (every output element of an MMA is summed alike). So under the
interpreter ``tensor_core_dot`` stands in for it, summing each element over K in one order;
what the tests check is then the kernels' own summation order (tile shapes, K walked from 0 by
one program, key tiles aligned to position 0), which is what makes them invariant on a GPU. On
CUDA the same tests run the compiled kernels, bf16 included.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from determinism import alone_and_batched_in_small_steps, assert_answers_are_invariant, tiny_prompts
from engines import build_engine
from test_kernels import make_batch
from tiny_models import build_tiny_model

from kernels.interface import FP8_DTYPE, AttentionMetadata
from kernels.registry import ENV_VAR
from kernels.triton.backend import TritonAttentionBackend
from kernels.triton.decode_attention import decode_attention
from kernels.triton.invariant import InvariantLinear, InvariantRMSNorm, linear, rms_norm

ON_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if ON_CUDA else "cpu"


@pytest.fixture(autouse=True)
def tensor_core_dot(monkeypatch):
    """Under the interpreter, a ``tl.dot`` that sums every output element over K in one order
    (products rounded to float32, then added from k = 0 up), wherever its row sits."""
    if ON_CUDA:
        return
    from triton.runtime import interpreter

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        a_data, b_data = a.data.astype(np.float32), b.data.astype(np.float32)
        block = np.zeros((a_data.shape[0], b_data.shape[1]), np.float32)
        for k in range(a_data.shape[1]):
            block += a_data[:, k, None] * b_data[None, k, :]
        return interpreter.TensorHandle(block.astype(d.data.dtype) + d.data, d.dtype.scalar)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)


@pytest.fixture(autouse=True)
def triton_backend(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "triton")


# The interpreter's tl.dot is wrong on bf16 operands (Triton 3.9): bf16 runs compiled only.
DTYPES = ["float32", "float16", *(["bfloat16"] if ON_CUDA else [])]


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_row_is_the_same_bits_in_any_batch(dtype):
    """``linear`` and ``rms_norm``: each row of a 150-row call equals the same row computed
    alone and at every place of a 6-row call, and both agree with torch to a rounding."""
    torch_dtype = getattr(torch, dtype)
    generator = torch.Generator().manual_seed(0)
    x, weight, bias = (
        torch.randn(shape, generator=generator).to(DEVICE, torch_dtype)
        for shape in ((150, 200), (130, 200), (130,))
    )
    full = linear(x, weight, bias)
    reference = torch.nn.functional.linear(x.float(), weight.float(), bias.float())
    torch.testing.assert_close(full.float(), reference, rtol=2e-2, atol=2e-2)
    norm_weight = weight[0].abs() + 0.5
    normed = rms_norm(x, norm_weight, 1e-6)
    for row in (0, 5, 63, 64, 149):
        assert torch.equal(linear(x[row : row + 1], weight, bias), full[row : row + 1])
        assert torch.equal(rms_norm(x[row : row + 1], norm_weight, 1e-6), normed[row : row + 1])
        start = max(0, row - 3)
        assert torch.equal(linear(x[start : start + 6], weight, bias), full[start : start + 6])


def assert_same_bits(got: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """``got`` has ``expected``'s bits; if not, the failure names each position (row) that
    differs, its heads that differ and by how much."""
    differs = got.view(torch.uint8) != expected.view(torch.uint8)
    differs = differs.view(*got.shape, -1).any(-1)  # [positions, heads, head_dim]
    if not differs.any():
        return
    gap = (got.float() - expected.float()).abs()
    rows = differs.flatten(1).any(1).nonzero().flatten().tolist()
    lines = [
        f"  position {row}: {int(differs[row].sum())} of {differs[row].numel()} values, heads "
        f"{differs[row].any(1).nonzero().flatten().tolist()}, largest difference "
        f"{gap[row].max().item():.3g}"
        for row in rows
    ]
    pytest.fail(
        f"{what}: {len(rows)} of {got.shape[0]} positions differ from the one-step prefill\n"
        + "\n".join(lines),
        pytrace=False,
    )


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv", ["model", "fp8"])
def test_deterministic_attention_gives_a_position_the_same_bits_however_it_is_batched(dtype, kv):
    """A token's attention output depends on its position and its context, never on how the
    step was cut: one 75-row prefill, decode rows one by one, or chunks after cached prefixes.
    The control: the split decode kernel, which the default mode uses for decode-only steps,
    gives a decode row other bits."""
    torch_dtype = getattr(torch, dtype)
    kv_dtype = torch_dtype if kv == "model" else FP8_DTYPE
    batch = make_batch(
        [75], [75], num_kv_heads=2, group=3, head_dim=64, dtype=torch_dtype, kv_dtype=kv_dtype
    )
    backend = TritonAttentionBackend(deterministic=True)
    scale = 64**-0.5
    whole = backend.attention(batch.query, batch.cache, batch.meta, scale)
    for cuts in ([0, 1, 2, 3, 75], list(range(76)), [0, 20, 21, 60, 75], [0, 64, 65, 75]):
        lens = [end - start for start, end in itertools.pairwise(cuts)]
        meta = AttentionMetadata(
            query_start_loc=torch.tensor(cuts, dtype=torch.int32, device=DEVICE),
            seq_lens=torch.tensor(cuts[1:], dtype=torch.int32, device=DEVICE),
            page_tables=batch.meta.page_tables.expand(len(lens), -1),
            slot_mapping=batch.meta.slot_mapping,
            max_query_len=max(lens),
            max_seq_len=75,
        )
        got = backend.attention(batch.query, batch.cache, meta, scale)
        assert_same_bits(got, whole, f"cut at {cuts if len(cuts) < 10 else 'every token'}")
    one_by_one = AttentionMetadata(
        query_start_loc=torch.arange(76, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.arange(1, 76, dtype=torch.int32, device=DEVICE),
        page_tables=batch.meta.page_tables.expand(75, -1),
        slot_mapping=batch.meta.slot_mapping,
        max_query_len=1,
        max_seq_len=75,
    )
    split = decode_attention(batch.query, batch.cache, one_by_one, scale, num_splits=4)
    torch.testing.assert_close(split.float(), whole.float(), rtol=1e-2, atol=1e-2)
    assert not torch.equal(split, whole)


# Compiles the prefill kernel for a GPU (this machine's, else an H100/H200's sm_90) with the
# compiler's FP contraction on and off, in a process of its own: Triton chooses between the
# interpreter and the compiler when the kernels are decorated. Small tiles compile in seconds;
# ``python -m benchmarks.step.compiled_kernels --contraction`` checks the table's.
_CONTRACTION_SCRIPT = """
import torch
from benchmarks.step.compiled_kernels import Case, contraction_differs
from kernels.triton.tiles import PrefillTiles

major, minor = torch.cuda.get_device_capability() if torch.cuda.is_available() else (9, 0)
for kv_quant in ("none", "fp8"):
    case = Case("prefill", "fp32", kv_quant, head_dim=64, tiles=PrefillTiles(32, 32, 4, 2))
    print(kv_quant, "differs" if contraction_differs(case, 10 * major + minor) else "same")
"""


@pytest.mark.slow
def test_attention_machine_code_does_not_depend_on_fp_contraction():
    """The cause of the compiled kernels' float32 defect, checked without a GPU. Where the
    compiler may fuse ``scores * scale - max`` into one FMA, it did so in the unmasked key tiles
    and not in the masked ones (a select stands between), so a position's output changed with
    how its step was cut. With every FMA written out the machine code is the same whether the
    compiler may fuse or not, so no tile rounds other than as written. (The previous kernel's
    code differed here, under Triton 3.6 and 3.9 alike.)"""
    nvidia = pytest.importorskip("triton.backends.nvidia")
    if not (Path(nvidia.__file__).parent / "bin" / "cuobjdump").exists():
        pytest.skip("this Triton has no NVIDIA toolchain to compile with")
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-c", _CONTRACTION_SCRIPT],
        cwd=Path(__file__).parent.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["none", "same", "fp8", "same"]


def test_bad_operands_are_refused():
    x = torch.randn(2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="does not match weight"):
        linear(x, torch.randn(4, 6, device=DEVICE))
    with pytest.raises(ValueError, match="one dtype"):
        linear(x, torch.randn(4, 8, device=DEVICE, dtype=torch.float16))
    with pytest.raises(ValueError, match="rms_norm"):
        rms_norm(x, torch.ones(7, device=DEVICE), 1e-6)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    """Qwen3's shape (q/k norms: every norm of the family); the bias is the kernel test's."""
    return build_tiny_model("qwen3-qknorm", tmp_path_factory.mktemp("qwen3"))


# Fewer and shorter requests than the C path's matrix: the interpreter runs a step in about a
# second. A seeded one, and two greedy ones on a 48-token shared prefix (cache hits).
PROMPTS = [tiny_prompts()[i] for i in (0, 5, 6)]
MAX_TOKENS = 6


@pytest.mark.slow
@pytest.mark.parametrize(
    "dtype, kv",
    [(dtype, "auto") for dtype in DTYPES] + [("float32", "fp8"), ("float32", "int8")],
)
def test_triton_answers_do_not_depend_on_batch_chunks_cache_or_speculation(tiny_folder, dtype, kv):
    engine = build_engine(tiny_folder, device=DEVICE, dtype=dtype, deterministic=True)
    assert engine.backend.name == "triton"
    model = engine.model
    assert isinstance(model.head, InvariantLinear)
    assert isinstance(model.norm, InvariantRMSNorm)
    assert isinstance(model.decoder_layers()[0].self_attn.q_norm, InvariantRMSNorm)
    assert isinstance(model.decoder_layers()[0].mlp.down_proj, InvariantLinear)
    assert_answers_are_invariant(
        tiny_folder, PROMPTS, MAX_TOKENS, device=DEVICE, dtype=dtype, kv_cache_dtype=kv
    )


@pytest.mark.slow
def test_without_the_flag_the_triton_path_differs(tiny_folder):
    """The control: the default mode's kernels (torch's linear layers on a GPU, the C GEMMs
    here; the split decode kernel) change some logprob of the same requests between one at a
    time and batched in small steps."""
    alone, batched = alone_and_batched_in_small_steps(
        tiny_folder, PROMPTS, MAX_TOKENS, device=DEVICE
    )
    assert batched != alone
