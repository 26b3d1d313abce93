"""The Triton kernels against their torch twins in ``tests/kernel_twins.py``.

Without CUDA the kernels run in Triton's interpreter (``tests/conftest.py``), so sizes are small
but chosen to cross every boundary: several query and key tiles, context lengths of 1 and
non-multiples of the page size, pages scattered over the pool, GQA groups that are not powers of
two, and one pool whose offsets overflow int32.

Every pool starts filled with NaN (0x7F bytes for FP8; int8 has no NaN, so 127 at the largest
scale), and page tables are padded with a page that is never written: a kernel that reads an
unwritten slot returns NaN, or something far off, and fails.

Tolerances: float32 runs differ from the reference only in summation order and exp2 vs exp
(~1e-6); fp16/bf16 runs also round the probabilities to the query dtype before P @ V, as
FlashAttention does, and round the output (2^-11 relative for fp16, 2^-8 for bf16). FP8 and
int8 pages are dequantised exactly, so quantised pages add no tolerance of their own.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import weakref
from dataclasses import dataclass

import pytest
import torch
from kernel_twins import paged_attention_twin, store_kv_twin
from triton_variants import compiled_on_gpu, new_variants, record_variants

from kernels.interface import (
    FP8_DTYPE,
    INT8_DTYPE,
    INT8_SCALE_DTYPE,
    AttentionMetadata,
    KVCacheView,
)
from kernels.kv_formats import dequantize_int8, int8_scale
from kernels.registry import get_attention_backend
from kernels.sizes import ceil_div, next_power_of_2
from kernels.torch_backend import TorchAttentionBackend
from kernels.triton.backend import TritonAttentionBackend
from kernels.triton.decode_attention import (
    _decode_kernel,
    decode_attention,
    default_num_splits,
    split_counts_to_compile,
    splits_to_fill,
)
from kernels.triton.elementwise import rope_
from kernels.triton.invariant import _rms_norm_kernel, rms_norm
from kernels.triton.paged import check_cache
from kernels.triton.prefill_attention import _prefill_kernel, prefill_attention
from kernels.triton.store_kv import rotate_and_store_kv, store_kv
from kernels.triton.tiles import (
    DECODE_CANDIDATES,
    DEFAULT_DECODE,
    DEFAULT_PREFILL,
    PREFILL_CANDIDATES,
    DecodeTiles,
    PrefillTiles,
    decode_tiles,
    prefill_tiles,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

TOLERANCE = {
    torch.float32: {"atol": 2e-5, "rtol": 1e-4},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
    torch.bfloat16: {"atol": 1.6e-2, "rtol": 1.6e-2},
}


def on_gpu_only_for_bf16(*values: object) -> object:
    """A parameter set that uses bf16 attention: marked ``gpu``, and skipped in the interpreter.

    Triton 3.9's interpreter computes tl.dot wrongly on bf16 operands, so bf16 attention is
    checked only where the kernels are compiled.
    """
    return pytest.param(
        *values,
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(INTERPRETED, reason="interpreter tl.dot is wrong on bf16"),
        ],
    )


def dtype_id(value: object) -> str | None:
    return str(value).removeprefix("torch.") if isinstance(value, torch.dtype) else None


DTYPES = [torch.float16, torch.float32, on_gpu_only_for_bf16(torch.bfloat16)]
QUANTIZED_KV_DTYPES = [FP8_DTYPE, INT8_DTYPE]
# (num_kv_heads, query heads per KV head): GQA ratios 1, 3 and 4.
GQA = [(2, 1), (2, 3), (1, 4)]


@dataclass
class Pool:
    """One page-major pool, ``(num_pages, num_layers, 2, page_size, num_kv_heads, head_dim)``."""

    pages: torch.Tensor
    scales: torch.Tensor | None  # (num_pages, num_layers, 2, page_size, num_kv_heads)

    @classmethod
    def create(
        cls,
        num_pages: int,
        *,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        num_layers: int = 2,
    ) -> Pool:
        shape = (num_pages, num_layers, 2, page_size, num_kv_heads, head_dim)
        if dtype == FP8_DTYPE:
            pages = torch.full(shape, 0x7F, dtype=torch.uint8, device=DEVICE).view(FP8_DTYPE)
            scales = torch.full(shape[:-1], float("nan"), device=DEVICE)
            return cls(pages, scales)
        if dtype == INT8_DTYPE:
            # int8 has no NaN: unwritten slots hold the largest values there are (127 at the
            # largest scale, about 4.9e5), so a kernel that reads one is far off.
            pages = torch.full(shape, 127, dtype=INT8_DTYPE, device=DEVICE)
            scales = torch.full(shape[:-1], 255, dtype=INT8_SCALE_DTYPE, device=DEVICE)
            return cls(pages, scales)
        return cls(torch.full(shape, float("nan"), dtype=dtype, device=DEVICE), None)

    def layer(self, layer: int) -> KVCacheView:
        if self.scales is None:
            return KVCacheView(self.pages[:, layer, 0], self.pages[:, layer, 1])
        return KVCacheView(
            self.pages[:, layer, 0],
            self.pages[:, layer, 1],
            self.scales[:, layer, 0],
            self.scales[:, layer, 1],
        )

    def clone(self) -> Pool:
        return Pool(self.pages.clone(), None if self.scales is None else self.scales.clone())

    def assert_matches(self, expected: Pool) -> None:
        """Pages and scales equal ``expected``'s; unwritten (NaN) slots must still be NaN.

        On the CPU quantised pages and their scales must match byte for byte. On CUDA torch
        divides by a scalar as a multiplication by its reciprocal, so the reference's scales may
        be a float32 ulp off the kernel's exact division: an FP8 value on a rounding boundary
        may then be one e4m3 step off, and an int8 amax on a scale boundary may take the next
        scale code, which rescales its whole vector.
        """
        if self.scales is None or expected.scales is None:
            assert self.scales is None and expected.scales is None
            assert torch.equal(self.pages.view(torch.uint8), expected.pages.view(torch.uint8))
            return
        if DEVICE.type == "cpu":
            assert torch.equal(self.pages.view(torch.uint8), expected.pages.view(torch.uint8))
            assert torch.equal(self.scales.view(torch.uint8), expected.scales.view(torch.uint8))
            return
        if self.pages.dtype == INT8_DTYPE:
            code_steps = self.scales.int() - expected.scales.int()
            assert code_steps.abs().max().item() <= 1
            # With equal codes this is one int8 step; with codes one apart, each side is within
            # half a step of the true value.
            step = torch.maximum(int8_scale(self.scales), int8_scale(expected.scales))
            error = dequantize_int8(self.pages, self.scales) - dequantize_int8(
                expected.pages, expected.scales
            )
            assert (error.abs() <= step.unsqueeze(-1)).all()
            return
        steps = e4m3_index(self.pages) - e4m3_index(expected.pages)
        assert steps.abs().max().item() <= 1
        torch.testing.assert_close(
            self.scales, expected.scales, rtol=2.5e-7, atol=0, equal_nan=True
        )


def e4m3_index(pages: torch.Tensor) -> torch.Tensor:
    """Each e4m3 byte's position on the number line: neighbouring values differ by one."""
    byte = pages.view(torch.uint8).to(torch.int16)
    magnitude = byte & 0x7F
    return torch.where(byte >= 0x80, -magnitude, magnitude)


def page_tables_for(
    seq_lens: list[int], page_size: int, pages: torch.Tensor, padding_page: int
) -> torch.Tensor:
    """Give each sequence its pages from ``pages`` in order; pad the rest of each row."""
    width = max(ceil_div(n, page_size) for n in seq_lens) + 1
    tables = torch.full((len(seq_lens), width), padding_page, dtype=torch.int32)
    used = 0
    for i, n in enumerate(seq_lens):
        count = ceil_div(n, page_size)
        tables[i, :count] = pages[used : used + count]
        used += count
    return tables.to(DEVICE)


def slots_for(
    tables: torch.Tensor, page_size: int, starts: list[int], ends: list[int]
) -> torch.Tensor:
    """Slot ids of positions ``starts[i]:ends[i]`` of every sequence ``i``, flattened."""
    slots = []
    for i, (start, end) in enumerate(zip(starts, ends, strict=True)):
        pos = torch.arange(start, end)
        slots.append(tables[i].cpu().long()[pos // page_size] * page_size + pos % page_size)
    return torch.cat(slots).to(DEVICE)


@dataclass
class Batch:
    """A filled pool and the metadata of one forward of ``query_lens`` new tokens."""

    pool: Pool
    cache: KVCacheView
    meta: AttentionMetadata
    query: torch.Tensor


def make_batch(
    query_lens: list[int],
    seq_lens: list[int],
    *,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    dtype: torch.dtype,
    kv_dtype: torch.dtype,
    page_size: int = 16,
) -> Batch:
    """Scatter each sequence over random pages and store its whole context (reference store)."""
    total_pages = sum(ceil_div(n, page_size) for n in seq_lens)
    pool = Pool.create(
        total_pages + 2,
        page_size=page_size,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=kv_dtype,
    )
    # Page 0 is never written: it pads the page tables.
    tables = page_tables_for(seq_lens, page_size, torch.randperm(total_pages) + 1, 0)
    cache = pool.layer(1)
    slots = slots_for(tables, page_size, [0] * len(seq_lens), seq_lens)
    source_dtype = dtype if kv_dtype in (FP8_DTYPE, INT8_DTYPE) else kv_dtype
    shape = (slots.shape[0], num_kv_heads, head_dim)
    key = torch.randn(shape, device=DEVICE).to(source_dtype)
    value = torch.randn(shape, device=DEVICE).to(source_dtype)
    store_kv_twin(key, value, cache, slots)

    starts = torch.tensor([0, *query_lens]).cumsum(0).to(torch.int32)
    meta = AttentionMetadata(
        query_start_loc=starts.to(DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        page_tables=tables,
        slot_mapping=slots_for(
            tables, page_size, [n - q for n, q in zip(seq_lens, query_lens, strict=True)], seq_lens
        ),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
    )
    num_tokens = sum(query_lens)
    query = torch.randn(num_tokens, num_kv_heads * group, head_dim, device=DEVICE).to(dtype)
    return Batch(pool, cache, meta, query)


def assert_matches_reference(out: torch.Tensor, batch: Batch, dtype: torch.dtype) -> None:
    scale = batch.query.shape[-1] ** -0.5
    expected = paged_attention_twin(batch.query, batch.cache, batch.meta, scale)
    assert out.dtype == batch.query.dtype and out.shape == batch.query.shape
    torch.testing.assert_close(out.float(), expected.float(), **TOLERANCE[dtype])


# ---------------------------------------------------------------------------------------------
# KV store


@pytest.mark.parametrize(
    "source_dtype, kv_dtype",
    [
        (torch.float16, torch.float16),
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.float32),
        *(
            (source_dtype, kv_dtype)
            for kv_dtype in QUANTIZED_KV_DTYPES
            for source_dtype in (torch.float16, torch.bfloat16, torch.float32)
        ),
    ],
    ids=dtype_id,
)
@pytest.mark.parametrize("num_kv_heads, head_dim", [(1, 64), (3, 128)])
def test_store_kv_matches_reference(
    source_dtype: torch.dtype, kv_dtype: torch.dtype, num_kv_heads: int, head_dim: int
) -> None:
    """Pages and scales match the reference, and only the given slots change.

    The kernel encodes e4m3 with integer round-to-nearest-even (the interpreter's own float8
    cast is off by a whole binade when rounding carries), so on the CPU quantised pages are
    compared byte for byte: a one-ulp tolerance would let a kernel that truncates pass.
    """
    page_size, num_tokens = 16, 37
    pool = Pool.create(
        12, page_size=page_size, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=kv_dtype
    )
    expected = pool.clone()
    slots = torch.randperm(12 * page_size)[:num_tokens].to(DEVICE)
    # K and V as strided views of one fused projection, the way a model produces them.
    fused = torch.randn(num_tokens, 2 * num_kv_heads + 1, head_dim, device=DEVICE) * 4
    fused[3] = 0.0  # an all-zero vector takes the minimum scale
    fused[5, :, :8] = 1e-4  # e4m3 subnormals after scaling, int8 zeros
    fused = fused.to(source_dtype)
    key, value = fused[:, 1 : 1 + num_kv_heads], fused[:, 1 + num_kv_heads :]

    store_kv(key, value, pool.layer(1), slots)
    store_kv_twin(key, value, expected.layer(1), slots)
    pool.assert_matches(expected)


@pytest.mark.parametrize("kv_dtype", [torch.float32, *QUANTIZED_KV_DTYPES], ids=dtype_id)
def test_store_kv_skips_negative_slots(kv_dtype: torch.dtype) -> None:
    """A slot of -1 (a CUDA graph's padding row) writes nothing; the other rows are stored."""
    pool = Pool.create(4, page_size=16, num_kv_heads=2, head_dim=64, dtype=kv_dtype)
    expected = pool.clone()
    slots = torch.tensor([5, -1, 17, -1], device=DEVICE)
    key, value = (torch.randn(4, 2, 64, device=DEVICE) for _ in range(2))
    store_kv(key, value, pool.layer(0), slots)
    real = slots >= 0
    store_kv_twin(key[real], value[real], expected.layer(0), slots[real])
    pool.assert_matches(expected)


def test_store_kv_int8_scale_boundaries() -> None:
    """int8 scale codes at their edges, byte for byte against the twin.

    An amax of exactly 127 times a representable scale takes that scale's code, one float32 ulp
    more takes the next code and one ulp less keeps it; values on half steps round up; an
    all-zero vector and a tiny one take code 0, and an amax past the largest scale clips at
    code 255 with its values clamped to +-127.
    """
    head_dim = 64
    codes = torch.tensor([0, 1, 7, 8, 100, 159, 254, 255], dtype=INT8_SCALE_DTYPE)
    scales = int8_scale(codes)
    on = scales * 127  # exact: 7 bits times a 4-bit mantissa
    amaxes = torch.cat([on, torch.nextafter(on, on * 2), torch.nextafter(on, on * 0)])
    expected_codes = torch.cat([codes, (codes.int() + 1).clamp(max=255), codes]).int()
    step = int8_scale(expected_codes.to(INT8_SCALE_DTYPE))

    vectors = (torch.rand(amaxes.shape[0], head_dim) * 2 - 1) * amaxes[:, None] * 0.9
    vectors[:, 0] = amaxes
    vectors[1::2, 0] *= -1  # the amax on either sign
    vectors[:, 1] = 3.5 * step  # half steps, exact in float32: round up
    vectors[:, 2] = -60.5 * step
    zero = torch.zeros(1, head_dim)
    tiny = torch.randn(1, head_dim) * 1e-9  # amax / 127 far below the smallest scale
    huge = torch.randn(1, head_dim) * 1e6  # far past 127 * the largest scale
    vectors = torch.cat([vectors, zero, tiny, huge])
    expected_codes = torch.cat([expected_codes, torch.tensor([0, 0, 255], dtype=torch.int32)])

    num_tokens, page_size = vectors.shape[0], 16
    pool = Pool.create(
        ceil_div(num_tokens, page_size) + 1,
        page_size=page_size,
        num_kv_heads=1,
        head_dim=head_dim,
        dtype=INT8_DTYPE,
    )
    expected = pool.clone()
    slots = torch.randperm(pool.pages.shape[0] * page_size)[:num_tokens].to(DEVICE)
    key = vectors.to(DEVICE)[:, None]
    store_kv(key, -key, pool.layer(0), slots)
    store_kv_twin(key, -key, expected.layer(0), slots)
    pool.assert_matches(expected)

    # Half steps round up: 3.5 -> 4 and -60.5 -> -60 in the keys, -3.5 -> -3 and 60.5 -> 61 in
    # the values.
    cache = pool.layer(0)
    for scale_codes, pages, halves in (
        (cache.key_scale, cache.key, [4, -60]),
        (cache.value_scale, cache.value, [-3, 61]),
    ):
        assert scale_codes is not None
        assert torch.equal(scale_codes.flatten(0, 1)[slots, 0].int().cpu(), expected_codes)
        stored = pages.flatten(0, 1)[slots, 0].int().cpu()
        assert torch.equal(stored[:-3, 1:3], torch.tensor(halves).expand(num_tokens - 3, 2))
        assert not stored[-3:-1].any()
        assert stored[-1].abs().max() == 127


@pytest.mark.parametrize("kv_dtype", QUANTIZED_KV_DTYPES, ids=dtype_id)
def test_store_kv_rejects_bad_input(kv_dtype: torch.dtype) -> None:
    pool = Pool.create(4, page_size=16, num_kv_heads=2, head_dim=64, dtype=kv_dtype)
    key = torch.randn(3, 2, 64, device=DEVICE)
    slots = torch.arange(3, device=DEVICE)
    with pytest.raises(ValueError, match="slot_mapping"):
        store_kv(key, key, pool.layer(0), slots.int())
    with pytest.raises(ValueError, match="scale"):
        store_kv(key, key, KVCacheView(pool.pages[:, 0, 0], pool.pages[:, 0, 1]), slots)
    with pytest.raises(ValueError, match="key must be"):
        store_kv(key[:, :1], key, pool.layer(0), slots)
    fp16 = Pool.create(4, page_size=16, num_kv_heads=2, head_dim=64, dtype=torch.float16)
    with pytest.raises(ValueError, match="cache is"):
        store_kv(key, key, fp16.layer(0), slots)
    # The other quantised dtype's scales: float32 beside int8 pages, codes beside FP8 pages.
    other = Pool.create(
        4,
        page_size=16,
        num_kv_heads=2,
        head_dim=64,
        dtype=FP8_DTYPE if kv_dtype == INT8_DTYPE else INT8_DTYPE,
    )
    assert pool.scales is not None and other.scales is not None
    swapped = KVCacheView(
        pool.pages[:, 0, 0], pool.pages[:, 0, 1], other.scales[:, 0, 0], other.scales[:, 0, 1]
    )
    with pytest.raises(ValueError, match=f"scales of a {kv_dtype} cache must be"):
        store_kv(key, key, swapped, slots)


def test_a_view_is_checked_once_and_not_kept_alive_by_it() -> None:
    """The kernels check a layer's view at each launch, and the check is kept beside the view:
    a view on another device than the inputs is still refused after it passed, a malformed one
    every time, and the kept check does not keep the view alive."""
    pool = Pool.create(4, page_size=16, num_kv_heads=2, head_dim=64, dtype=FP8_DTYPE)
    view = pool.layer(0)
    device = view.key.device  # as the kernels pass it, an input tensor's (cuda:0, not cuda)
    assert check_cache(view, device) is check_cache(view, device)
    with pytest.raises(ValueError, match="inputs on meta"):
        check_cache(view, torch.device("meta"))
    unscaled = KVCacheView(view.key, view.value)
    for _ in range(2):
        with pytest.raises(ValueError, match="needs key_scale"):
            check_cache(unscaled, device)
    dead = weakref.ref(view)
    del view
    gc.collect()
    assert dead() is None


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("kv_dtype", [None, *QUANTIZED_KV_DTYPES], ids=dtype_id)
@pytest.mark.parametrize(
    "num_heads, num_kv_heads, head_dim",
    [(4, 2, 64), (12, 3, 80)],  # the second: two blocks of query heads, a head_dim off 2^n
)
def test_rotate_and_store_kv_gives_rope_then_the_store(
    dtype: torch.dtype,
    kv_dtype: torch.dtype | None,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> None:
    """The one launch gives the bits of the two it stands in for: RoPE's kernel on the queries
    and on the keys (``kernels/triton/elementwise.py``, the twin's bits), then the store; the key
    and value it was given are left as they were, and a padding row's queries are rotated too."""
    torch.manual_seed(3)
    num_tokens, page_size = 21, 16
    pool = Pool.create(
        4,
        page_size=page_size,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=kv_dtype or dtype,
    )
    expected_pool = pool.clone()
    slots = torch.randperm(4 * page_size)[:num_tokens].to(DEVICE)
    slots[[2, 11]] = -1
    # q, k and v as the attention makes them: views of one qkv buffer.
    sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
    qkv = (torch.randn(num_tokens, sum(sizes), device=DEVICE) * 3).to(dtype)
    q, k, v = (
        part.unflatten(-1, (-1, head_dim)) for part in qkv.split(sizes, dim=-1)
    )  # fmt: skip
    angles = torch.rand(num_tokens, head_dim // 2, device=DEVICE) * 100
    cos, sin = (f(torch.cat((angles, angles), dim=-1)).to(dtype) for f in (torch.cos, torch.sin))
    expected_q, expected_k = rope_(q.clone(), cos, sin), rope_(k.clone(), cos, sin)
    store_kv(expected_k, v, expected_pool.layer(0), slots)
    k_before, v_before = k.clone(), v.clone()

    rotate_and_store_kv(
        query=q, key=k, value=v, cos=cos, sin=sin, cache=pool.layer(0), slot_mapping=slots
    )
    assert torch.equal(q, expected_q)
    pool.assert_matches(expected_pool)
    assert torch.equal(k, k_before) and torch.equal(v, v_before)


def test_rotate_and_store_kv_rejects_what_it_cannot_rotate() -> None:
    pool = Pool.create(4, page_size=16, num_kv_heads=2, head_dim=64, dtype=torch.float16)
    query, key = (torch.randn(3, n, 64, device=DEVICE).half() for n in (4, 2))
    angles = torch.randn(3, 64, device=DEVICE).half()
    slots = torch.arange(3, device=DEVICE)
    float32_pool = Pool.create(4, page_size=16, num_kv_heads=2, head_dim=64, dtype=torch.float32)
    with pytest.raises(ValueError, match="query must be"):
        rotate_and_store_kv(
            query=query.float(),
            key=key.float(),
            value=key.float(),
            cos=angles,
            sin=angles,
            cache=float32_pool.layer(0),
            slot_mapping=slots,
        )
    with pytest.raises(ValueError, match="query must be"):
        rotate_and_store_kv(
            query=query[:2],
            key=key,
            value=key,
            cos=angles,
            sin=angles,
            cache=pool.layer(0),
            slot_mapping=slots,
        )
    with pytest.raises(ValueError, match="cos must be"):
        rotate_and_store_kv(
            query=query,
            key=key,
            value=key,
            cos=angles[:, :32],
            sin=angles,
            cache=pool.layer(0),
            slot_mapping=slots,
        )
    with pytest.raises(ValueError, match="RoPE rounds to one"):
        rotate_and_store_kv(
            query=query.bfloat16(),
            key=key,
            value=key,
            cos=angles,
            sin=angles,
            cache=pool.layer(0),
            slot_mapping=slots,
        )
    odd = Pool.create(4, page_size=16, num_kv_heads=2, head_dim=63, dtype=torch.float16)
    with pytest.raises(ValueError, match="odd"):
        rotate_and_store_kv(
            query=query[..., :63],
            key=key[..., :63],
            value=key[..., :63],
            cos=angles[:, :63],
            sin=angles[:, :63],
            cache=odd.layer(0),
            slot_mapping=slots,
        )


# ---------------------------------------------------------------------------------------------
# Chunked-prefill attention

# (query_lens, seq_lens): the chunk of each sequence and its context length after this step.
PREFILL_BATCHES = {
    # A single token of context: q = 1 through the prefill kernel.
    "one-token": ([1], [1]),
    # A whole prompt: several query tiles and key tiles under the causal mask.
    "prompt": ([150], [150]),
    # Chunks over cached prefixes, a decode row among them, one chunk ending on a page boundary.
    "chunks": ([20, 1, 7, 33], [53, 1, 16, 100]),
    # Speculative verification: a few tokens on long contexts.
    "verify": ([4, 3, 5], [77, 30, 5]),
}


@pytest.mark.parametrize("batch_name", list(PREFILL_BATCHES))
@pytest.mark.parametrize("num_kv_heads, group", GQA)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_prefill_attention_matches_reference(
    batch_name: str, num_kv_heads: int, group: int, head_dim: int, dtype: torch.dtype
) -> None:
    query_lens, seq_lens = PREFILL_BATCHES[batch_name]
    batch = make_batch(
        query_lens,
        seq_lens,
        num_kv_heads=num_kv_heads,
        group=group,
        head_dim=head_dim,
        dtype=dtype,
        kv_dtype=dtype,
    )
    out = prefill_attention(batch.query, batch.cache, batch.meta, head_dim**-0.5)
    assert_matches_reference(out, batch, dtype)


@pytest.mark.parametrize("batch_name", ["chunks", "verify"])
@pytest.mark.parametrize("num_kv_heads, group", GQA)
@pytest.mark.parametrize(
    "head_dim, dtype",
    [(64, torch.float32), (128, torch.float16), on_gpu_only_for_bf16(128, torch.bfloat16)],
    ids=dtype_id,
)
@pytest.mark.parametrize("kv_dtype", QUANTIZED_KV_DTYPES, ids=dtype_id)
def test_prefill_attention_quantized(
    batch_name: str,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    dtype: torch.dtype,
    kv_dtype: torch.dtype,
) -> None:
    query_lens, seq_lens = PREFILL_BATCHES[batch_name]
    batch = make_batch(
        query_lens,
        seq_lens,
        num_kv_heads=num_kv_heads,
        group=group,
        head_dim=head_dim,
        dtype=dtype,
        kv_dtype=kv_dtype,
    )
    out = prefill_attention(batch.query, batch.cache, batch.meta, head_dim**-0.5)
    assert_matches_reference(out, batch, dtype)


@pytest.mark.parametrize("page_size, head_dim", [(5, 80), (32, 64)])
def test_prefill_attention_other_layouts(page_size: int, head_dim: int) -> None:
    """A page size that is not a power of two and a head_dim that needs padding."""
    batch = make_batch(
        [9, 1, 30],
        [40, 3, 30],
        num_kv_heads=2,
        group=3,
        head_dim=head_dim,
        dtype=torch.float32,
        kv_dtype=torch.float32,
        page_size=page_size,
    )
    out = prefill_attention(batch.query, batch.cache, batch.meta, head_dim**-0.5)
    assert_matches_reference(out, batch, torch.float32)


# ---------------------------------------------------------------------------------------------
# Paged decode attention

DECODE_SEQ_LENS = {
    "one-token": [1],
    # Lengths of 1, exactly one page, one past it, and long enough to split.
    "mixed": [1, 16, 17, 300],
}


@pytest.mark.parametrize("seqs_name", list(DECODE_SEQ_LENS))
@pytest.mark.parametrize("num_kv_heads, group", GQA)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize(
    "kv_dtype", [None, *QUANTIZED_KV_DTYPES], ids=["kv-native", "kv-fp8", "kv-int8"]
)
def test_decode_attention_matches_reference(
    seqs_name: str,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    dtype: torch.dtype,
    kv_dtype: torch.dtype | None,
) -> None:
    """``kv_dtype`` None: pages in the query's dtype."""
    seq_lens = DECODE_SEQ_LENS[seqs_name]
    batch = make_batch(
        [1] * len(seq_lens),
        seq_lens,
        num_kv_heads=num_kv_heads,
        group=group,
        head_dim=head_dim,
        dtype=dtype,
        kv_dtype=kv_dtype or dtype,
    )
    out = decode_attention(batch.query, batch.cache, batch.meta, head_dim**-0.5)
    assert_matches_reference(out, batch, dtype)


# ---------------------------------------------------------------------------------------------
# Tile sizes: every candidate the tuner may choose is exact


@pytest.mark.parametrize("tiles", PREFILL_CANDIDATES, ids=str)
@pytest.mark.parametrize(
    "dtype, kv_dtype",
    [(torch.float32, FP8_DTYPE), on_gpu_only_for_bf16(torch.bfloat16, FP8_DTYPE)],
    ids=dtype_id,
)
def test_prefill_attention_every_tile_candidate(
    tiles: PrefillTiles, dtype: torch.dtype, kv_dtype: torch.dtype
) -> None:
    """Chunks over cached prefixes cross the unmasked tiles' end at every candidate's key tile;
    a GQA group of 3 leaves query tiles with padding rows."""
    query_lens, seq_lens = PREFILL_BATCHES["chunks"]
    batch = make_batch(
        query_lens, seq_lens, num_kv_heads=2, group=3, head_dim=64, dtype=dtype, kv_dtype=kv_dtype
    )
    out = prefill_attention(batch.query, batch.cache, batch.meta, 64**-0.5, tiles=tiles)
    assert_matches_reference(out, batch, dtype)


@pytest.mark.parametrize("tiles", DECODE_CANDIDATES, ids=str)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_attention_every_tile_candidate(tiles: DecodeTiles, num_splits: int) -> None:
    batch = make_batch(
        [1] * 4,
        DECODE_SEQ_LENS["mixed"],
        num_kv_heads=2,
        group=4,
        head_dim=64,
        dtype=torch.float32,
        kv_dtype=FP8_DTYPE,
    )
    out = decode_attention(
        batch.query, batch.cache, batch.meta, 64**-0.5, num_splits=num_splits, tiles=tiles
    )
    assert_matches_reference(out, batch, torch.float32)


def test_the_hosts_block_sizes_are_tritons() -> None:
    """The launches' block sizes come from ``kernels.sizes``, not from Triton's constexpr
    functions (microseconds a call on the host): the same numbers."""
    import triton

    for n in [*range(1, 2100), 2**20 - 1, 2**20, 2**20 + 1]:
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
        assert ceil_div(n, 7) == triton.cdiv(n, 7) and ceil_div(n, 64) == triton.cdiv(n, 64)
    assert next_power_of_2(0) == 1  # a block of at least one


def test_tiles_fit_the_head_size() -> None:
    """Heads of 256 halve the tiles, heads of 64 run on at most 4 warps, decode tiles hold as
    many bytes whatever the page's element size; a GQA group wider than the query tile widens it
    to the group."""
    cpu = torch.device("cpu")
    assert prefill_tiles(cpu, 128, "none") == DEFAULT_PREFILL
    assert prefill_tiles(cpu, 256, "fp8") == PrefillTiles(64, 32, 8, DEFAULT_PREFILL.num_stages)
    assert prefill_tiles(cpu, 64, "none").num_warps == 4
    assert decode_tiles(cpu, 128, "none", 2) == DEFAULT_DECODE
    assert decode_tiles(cpu, 256, "none", 2).block_n == 32
    # Decode tiles hold a 64-key bf16 tile's bytes: 128 keys of 8-bit pages, 32 of float32.
    assert decode_tiles(cpu, 128, "int8", 1).block_n == 2 * DEFAULT_DECODE.block_n
    assert decode_tiles(cpu, 128, "fp8", 1).block_n == 2 * DEFAULT_DECODE.block_n
    assert decode_tiles(cpu, 128, "none", 4).block_n == DEFAULT_DECODE.block_n // 2
    # MQA of 128 query heads over one KV head: a 64-row candidate still holds a whole group.
    batch = make_batch(
        [2, 1],
        [5, 9],
        num_kv_heads=1,
        group=128,
        head_dim=16,
        dtype=torch.float32,
        kv_dtype=torch.float32,
    )
    out = prefill_attention(
        batch.query, batch.cache, batch.meta, 16**-0.5, tiles=PrefillTiles(64, 32, 4, 2)
    )
    assert_matches_reference(out, batch, torch.float32)


def test_tuner_choice(capsys: pytest.CaptureFixture[str]) -> None:
    """The tuner keeps the candidate with the best geometric-mean gain over the default among
    those that ran in every case."""
    from benchmarks.step.triton_kernels import report_candidates as report

    default, fast_once, steady, fails = DECODE_CANDIDATES[:4]
    rows = {
        "a": [100.0, 400.0, 150.0, 900.0],
        "b": [100.0, 50.0, 150.0, None],  # fast_once: 2x a, 0.5x b (1.0 mean); steady: 1.5x
    }
    candidates = [default, fast_once, steady, fails]
    assert report("decode", "GB/s", candidates=candidates, default=default, rows=rows) == steady
    assert "1.50x the default" in capsys.readouterr().out
    only_default = {"a": [100.0, None, None, None]}
    chosen = report("decode", "GB/s", candidates=candidates, default=default, rows=only_default)
    assert chosen == default


@pytest.mark.parametrize("num_splits", [1, 2, 3, 7])
@pytest.mark.parametrize("kv_dtype", QUANTIZED_KV_DTYPES, ids=dtype_id)
def test_decode_attention_split_k(num_splits: int, kv_dtype: torch.dtype) -> None:
    """Any number of splits, including more splits than a short sequence has key tiles."""
    batch = make_batch(
        [1] * 4,
        [1, 16, 17, 300],
        num_kv_heads=2,
        group=4,
        head_dim=64,
        dtype=torch.float32,
        kv_dtype=kv_dtype,
    )
    out = decode_attention(batch.query, batch.cache, batch.meta, 64**-0.5, num_splits=num_splits)
    assert_matches_reference(out, batch, torch.float32)


def test_decode_splits_fill_the_gpu() -> None:
    """Few sequences get splits enough for four programs per multiprocessor (132 on an H100 or
    H200; 8 KV heads), none shorter than 256 tokens; a full batch gets none."""
    assert splits_to_fill(1, 8, 32768, 132) == 66  # 528 programs of 497 keys each
    assert splits_to_fill(16, 8, 4096, 132) == 5
    assert splits_to_fill(1, 8, 300, 132) == 2  # by length
    assert splits_to_fill(256, 8, 4096, 132) == 1
    assert splits_to_fill(1, 1, 10**6, 132) == 128  # the most there may be


def test_decode_attention_rejects_prefill_metadata() -> None:
    batch = make_batch(
        [2, 1],
        [5, 9],
        num_kv_heads=1,
        group=2,
        head_dim=64,
        dtype=torch.float32,
        kv_dtype=torch.float32,
    )
    with pytest.raises(ValueError, match="one query per sequence"):
        decode_attention(batch.query, batch.cache, batch.meta, 0.125)
    bad = dataclasses.replace(batch.meta, query_start_loc=batch.meta.query_start_loc.long())
    with pytest.raises(ValueError, match="query_start_loc"):
        prefill_attention(batch.query, batch.cache, bad, 0.125)
    # The kernels scale a row's max score, not each score: exact only for a positive scale.
    with pytest.raises(ValueError, match="softmax_scale must be positive"):
        prefill_attention(batch.query, batch.cache, batch.meta, -0.125)


# ---------------------------------------------------------------------------------------------
# The backend: store, then attend, over a mixed batch


@pytest.mark.parametrize(
    "dtype, kv_dtype, head_dim",
    [
        (torch.float16, torch.float16, 128),
        (torch.float32, FP8_DTYPE, 64),
        on_gpu_only_for_bf16(torch.bfloat16, FP8_DTYPE, 128),
        (torch.float16, INT8_DTYPE, 128),
        (torch.float32, INT8_DTYPE, 64),
        on_gpu_only_for_bf16(torch.bfloat16, INT8_DTYPE, 128),
    ],
    ids=dtype_id,
)
def test_backend_mixed_batch(dtype: torch.dtype, kv_dtype: torch.dtype, head_dim: int) -> None:
    """Two forwards through each backend on its own pool: a first chunk of two prompts, then a
    mixed step where two sequences decode and two prefill chunks over a cached prefix, then a
    pure decode step. Pools and outputs must agree at every step."""
    num_kv_heads, group, page_size = 2, 3, 16
    triton_backend = get_attention_backend(DEVICE, "triton")
    torch_backend = TorchAttentionBackend()
    assert isinstance(triton_backend, TritonAttentionBackend)

    # Sequences 0 and 1 are prompts of 25 and 40 tokens, prefilled as 18 + 7 and 16 + 24;
    # 2 and 3 were prefilled earlier (30 and 3 tokens) and now decode.
    steps = [
        ([0, 1, 2, 3], [0, 0, 0, 0], [18, 16, 30, 3]),  # prefill everything cached so far
        ([0, 1, 2, 3], [18, 16, 30, 3], [25, 40, 31, 4]),  # mixed: chunks and decodes
        ([0, 1, 2, 3], [25, 40, 31, 4], [26, 41, 32, 5]),  # pure decode
    ]
    final_lens = steps[-1][2]
    total_pages = sum(ceil_div(n, page_size) for n in final_lens)
    pool = Pool.create(
        total_pages + 1,
        page_size=page_size,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=kv_dtype,
    )
    tables = page_tables_for(final_lens, page_size, torch.randperm(total_pages) + 1, 0)
    pools = {"triton": pool, "torch": pool.clone()}
    for _, starts, ends in steps:
        query_lens = [e - s for s, e in zip(starts, ends, strict=True)]
        slots = slots_for(tables, page_size, starts, ends)
        num_tokens = slots.shape[0]
        query, key, value = (
            torch.randn(num_tokens, num_kv_heads * heads, head_dim, device=DEVICE).to(dtype)
            for heads in (group, 1, 1)
        )
        meta = AttentionMetadata(
            query_start_loc=torch.tensor([0, *query_lens]).cumsum(0).to(torch.int32).to(DEVICE),
            seq_lens=torch.tensor(ends, dtype=torch.int32, device=DEVICE),
            page_tables=tables,
            slot_mapping=slots,
            max_query_len=max(query_lens),
            max_seq_len=max(ends),
        )
        outputs = {}
        for name, backend in (("triton", triton_backend), ("torch", torch_backend)):
            backend.store_kv(key, value, pools[name].layer(0), meta.slot_mapping)
        pools["triton"].assert_matches(pools["torch"])
        # On CUDA the two stores may leave a value one e4m3 step (or an int8 vector one scale
        # code) apart, which the output tolerance does not cover: a prompt's first token sees
        # only its own value. So the backends attend over the same bytes, the Triton store's.
        pools["torch"] = pools["triton"].clone()
        for name, backend in (("triton", triton_backend), ("torch", torch_backend)):
            outputs[name] = backend.attention(query, pools[name].layer(0), meta, head_dim**-0.5)
        torch.testing.assert_close(
            outputs["triton"].float(), outputs["torch"].float(), **TOLERANCE[dtype]
        )


def test_registry_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_ATTENTION_BACKEND", "triton")
    assert get_attention_backend(torch.device("cpu")).name == "triton"
    monkeypatch.setenv("PDSERVE_ATTENTION_BACKEND", "torch")
    assert get_attention_backend(torch.device("cuda")).name == "torch"


# ---------------------------------------------------------------------------------------------
# A pool past int32 offsets


@pytest.mark.parametrize("kv_dtype", [torch.float16, *QUANTIZED_KV_DTYPES], ids=dtype_id)
def test_pool_offsets_beyond_int32(kv_dtype: torch.dtype) -> None:
    """Page id x page stride > 2^31 elements: every kernel must index in int64.

    torch.empty reserves a pool without touching it, and the interpreter reads CPU tensors in
    place, so only the few highest pages used here are ever paged in (a few MiB resident).
    """
    page_size, num_kv_heads, head_dim = 16, 1, 64
    page_elements = 2 * page_size * num_kv_heads * head_dim  # a single layer
    num_pages = 2**31 // page_elements + 8
    used = slice(num_pages - 8, num_pages)
    pools = {}
    for name in ("triton", "torch"):
        shape = (num_pages, 1, 2, page_size, num_kv_heads, head_dim)
        pages = torch.empty(shape, dtype=kv_dtype, device=DEVICE)
        # NaN; for int8 pages, 127 at the largest scale (as Pool.create fills them).
        pages[used].view(torch.uint8).fill_(0xFF if kv_dtype == torch.float16 else 0x7F)
        scales = None
        if kv_dtype == FP8_DTYPE:
            scales = torch.empty(shape[:-1], device=DEVICE)
            scales[used] = float("nan")
        elif kv_dtype == INT8_DTYPE:
            scales = torch.empty(shape[:-1], dtype=INT8_SCALE_DTYPE, device=DEVICE)
            scales[used] = 255
        pools[name] = Pool(pages, scales)
    assert (num_pages - 1) * pools["triton"].pages.stride(0) > 2**31

    # Five pages, highest first; the sixth pads the tables and is never written.
    seq_lens = [40, 7, 1]
    top = torch.arange(num_pages - 1, num_pages - 7, -1)
    tables = page_tables_for(seq_lens, page_size, top, num_pages - 6)
    slots = slots_for(tables, page_size, [0, 0, 0], seq_lens)
    key = torch.randn(slots.shape[0], num_kv_heads, head_dim, device=DEVICE).half()
    value = torch.randn_like(key)
    store_kv(key, value, pools["triton"].layer(0), slots)
    store_kv_twin(key, value, pools["torch"].layer(0), slots)
    used_pools = [
        Pool(pool.pages[used], None if pool.scales is None else pool.scales[used])
        for pool in pools.values()
    ]
    used_pools[0].assert_matches(used_pools[1])

    cache = pools["triton"].layer(0)
    for query_lens in ([1, 1, 1], [5, 7, 1]):  # the decode kernel, then the prefill kernel
        starts = torch.tensor([0, *query_lens]).cumsum(0).to(torch.int32)
        meta = AttentionMetadata(
            query_start_loc=starts.to(DEVICE),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
            page_tables=tables,
            slot_mapping=slots[:0],
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
        )
        query = torch.randn(sum(query_lens), 4, head_dim, device=DEVICE).half()
        out = TritonAttentionBackend().attention(query, cache, meta, head_dim**-0.5)
        assert_matches_reference(out, Batch(pools["triton"], cache, meta, query), torch.float16)


# ---------------------------------------------------------------------------------------------
# Compiled variants


@pytest.mark.gpu
def test_a_batch_of_another_size_compiles_no_new_kernel() -> None:
    """Triton specialises an integer argument that is 1 or a multiple of 16: a prefill batch of
    2 sequences after the start-up's 1, or 16 decode splits after 3, would compile the kernel
    again, a stall of seconds in front of a request. The counts that change from call to call are
    left unspecialised. A head size and group no other test uses, so no variant is there yet.
    (One split writes the output in place, and more than 4 combine in a wider block: those are
    other variants by design, and not counted here.)"""
    head_dim, group, half = 48, 3, torch.float16
    first: dict[str, int] = {}
    for count in (3, 1, 2, 16):
        batch = make_batch(
            [2] * count,
            [9] * count,
            num_kv_heads=1,
            group=group,
            head_dim=head_dim,
            dtype=half,
            kv_dtype=half,
        )
        prefill_attention(batch.query, batch.cache, batch.meta, head_dim**-0.5)
        rms_norm(batch.query.view(-1, head_dim), torch.ones(head_dim, device=DEVICE), 1e-6)
        if count > 1:
            one = make_batch(
                [1],
                [300],
                num_kv_heads=1,
                group=group,
                head_dim=head_dim,
                dtype=half,
                kv_dtype=half,
            )
            decode_attention(one.query, one.cache, one.meta, head_dim**-0.5, num_splits=count)
        counts = {
            "prefill": compiled_on_gpu(_prefill_kernel),
            "rms_norm": compiled_on_gpu(_rms_norm_kernel),
            "decode": compiled_on_gpu(_decode_kernel),
        }
        first = first or counts
        assert counts == first, f"a count of {count} compiled another variant"


@pytest.mark.skipif(not INTERPRETED, reason="works specialisations out in the interpreter")
def test_launching_every_variant_covers_every_split_count_a_decode_can_choose() -> None:
    """A decode batch's split count follows its size and context; 1 writes the output in place
    and more combine in a block as wide as the next power of two, each a compiled variant of its
    own. The start-up's decode, launched under ``launching_every_variant``, must have launched
    every variant that any split count the heuristic can choose on this device would need."""
    num_kv_heads, group, head_dim = 2, 3, 32
    batch = make_batch(
        [1],
        [40],
        num_kv_heads=num_kv_heads,
        group=group,
        head_dim=head_dim,
        dtype=torch.float32,
        kv_dtype=torch.float32,
    )
    backend = TritonAttentionBackend()
    scale = head_dim**-0.5
    with record_variants() as at_start_up, backend.launching_every_variant():
        backend.attention(batch.query, batch.cache, batch.meta, scale)
    most = split_counts_to_compile(num_kv_heads, DEVICE)[-1]
    assert most > 4, "more than one width of the combine's block"
    chosen = {
        default_num_splits(num_seqs, num_kv_heads, seq_len, DEVICE)
        for num_seqs in (1, 2, 5, 40)
        for seq_len in (1, 300, 2000, 10**6)
    }
    assert max(chosen) == most
    with record_variants() as later:
        for num_splits in range(1, most + 1):
            decode_attention(batch.query, batch.cache, batch.meta, scale, num_splits=num_splits)
        backend.attention(batch.query, batch.cache, batch.meta, scale)  # outside: one launch
    assert new_variants(at_start_up, later) == {}
    assert len(later["_combine_splits_kernel"]) == len(split_counts_to_compile(2, DEVICE)) - 1
