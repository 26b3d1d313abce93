"""Tensor parallelism inside one engine (``--tensor-parallel-size``): the slices each rank holds,
and a group of processes over gloo whose greedy tokens are the one-process engine's.

A TP group sums each row-parallel layer's output in another order than one process does, so
float32 logits differ in their last bits; the tiny models are built with a wide initialisation
(peaked logits), and where two tokens still nearly tie ``assert_greedy_equal_up_to_near_ties``
lets them part only there, both within a small gap of the best logit by transformers in fp32.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from engines import tp_engine_config
from tiny_models import (
    VOCAB_SIZE,
    assert_greedy_equal_up_to_near_ties,
    build_tiny_model,
    random_prompts,
    save_tiny_model,
    tiny_llama_config,
)

from common import metrics
from common.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SpeculativeConfig,
)
from common.engine.llm_engine import LLMEngine
from common.engine.tp_group import RANK_LOST_EXIT_CODE
from common.kv_layout import KVLayout
from common.model.loader import load_model
from common.model.parallel import TensorParallel, check_shardable
from common.sampling_params import SamplingParams

REPO = Path(__file__).resolve().parent.parent
NEW_TOKENS = 16
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)


def greedy(config: EngineConfig, prompts: list[list[int]]) -> list[list[int]]:
    engine = LLMEngine(config)
    try:
        return engine.generate(prompts, GREEDY)
    finally:
        engine.close()


@pytest.fixture(scope="module")
def two_kv_heads(tmp_path_factory) -> Path:
    """2 query heads over 2 KV heads, untied head, llama3 RoPE scaling."""
    return build_tiny_model("llama3-rope", tmp_path_factory.mktemp("llama3-rope"))


@pytest.fixture(scope="module")
def four_heads(tmp_path_factory) -> Path:
    """4 query heads over 2 KV heads and a vocabulary no TP size divides (the last rank's
    rows are padding): at TP 4 each KV head is held by two ranks."""
    config = tiny_llama_config(
        vocab_size=VOCAB_SIZE - 1,
        # LlamaConfig's defaults, which this model was always built with.
        bos_token_id=1,
        eos_token_id=2,
    )
    return save_tiny_model(config, tmp_path_factory.mktemp("four-heads"), seed=1)


# -- what each rank holds (no processes) ---------------------------------------------------------


def test_every_query_head_reads_a_kv_head_its_rank_holds():
    for num_heads, num_kv_heads, size in [(4, 2, 2), (4, 2, 4), (8, 2, 8), (6, 2, 2), (4, 1, 4)]:
        group = num_heads // num_kv_heads
        held = []
        for rank in range(size):
            tp = TensorParallel(rank, size)
            kv = tp.kv_heads(num_kv_heads)
            assert all(head // group in kv for head in tp.heads(num_heads))
            held.append(kv)
        assert sorted({head for kv in held for head in kv}) == list(range(num_kv_heads))


def test_a_size_that_does_not_divide_the_model_is_refused(four_heads):
    config = ModelConfig.from_pretrained(four_heads)
    check_shardable(config, 4)
    with pytest.raises(ValueError, match="does not divide its 4 attention heads"):
        check_shardable(config, 3)
    with pytest.raises(ValueError, match="does not divide its 4 attention heads"):
        LLMEngine(tp_engine_config(four_heads, 8))


@pytest.mark.parametrize("size", [2, 4])
def test_ranks_load_slices_that_make_up_the_whole_model(four_heads, size):
    """Each rank reads its slices; put side by side (the row-parallel ones by columns, KV
    heads held twice counted once) they are the whole checkpoint."""
    config = ModelConfig.from_pretrained(four_heads)
    whole = load_model(config, torch.float32, torch.device("cpu"))
    ranks = [
        load_model(config, torch.float32, torch.device("cpu"), tp=TensorParallel(rank, size))
        for rank in range(size)
    ]
    embed = torch.cat([model.embed_tokens.weight for model in ranks])
    assert torch.equal(embed[: config.vocab_size], whole.embed_tokens.weight)
    assert not embed[config.vocab_size :].any()  # the last rank's padding rows
    q_size, head_dim = config.num_heads * config.head_dim // size, config.head_dim
    for layer, parts in zip(
        whole.decoder_layers(), zip(*(m.decoder_layers() for m in ranks), strict=True), strict=True
    ):
        qkv = [part.self_attn.qkv_proj.weight for part in parts]
        assert torch.equal(
            torch.cat([w[:q_size] for w in qkv]), layer.self_attn.qkv_proj.weight[:64]
        )
        keys = {}
        for rank, weight in enumerate(qkv):
            for i, head in enumerate(TensorParallel(rank, size).kv_heads(config.num_kv_heads)):
                keys[head] = weight[q_size + i * head_dim : q_size + (i + 1) * head_dim]
        whole_keys = layer.self_attn.qkv_proj.weight[64:96]
        assert torch.equal(torch.cat([keys[h] for h in sorted(keys)]), whole_keys)
        o = torch.cat([part.self_attn.o_proj.weight for part in parts], dim=1)
        assert torch.equal(o, layer.self_attn.o_proj.weight)
        down = torch.cat([part.mlp.down_proj.weight for part in parts], dim=1)
        assert torch.equal(down, layer.mlp.down_proj.weight)


def test_dummy_weights_are_drawn_in_each_ranks_shape(four_heads):
    config = ModelConfig.from_pretrained(four_heads)
    model = load_model(config, torch.float32, torch.device("cpu"), "dummy", TensorParallel(1, 2))
    attention = model.decoder_layers()[0].self_attn
    assert (attention.num_heads, attention.num_kv_heads) == (2, 1)
    assert attention.qkv_proj.weight.shape == ((2 + 2 * 1) * config.head_dim, 64)
    assert model.embed_tokens.weight.shape == ((VOCAB_SIZE - 1 + 1) // 2, 64)
    assert attention.qkv_proj.weight.std() > 0.01


def test_a_rank_pool_layout_names_its_heads():
    """A rank's pool holds a slice of the model's KV heads: its layout says which, moves pages
    with a whole pool of the same model (each fetch names its heads, tests/test_kv_head_slices.py)
    and refuses heads it does not hold."""
    whole = KVLayout("bfloat16", 16, 2, 2, 64)
    rank1 = KVLayout("bfloat16", 16, 2, 1, 64, first_kv_head=1, model_kv_heads=2)
    assert rank1.problem() is None and rank1.heads == range(1, 2)
    assert whole.mismatch(rank1) is None and rank1.mismatch(whole) is None
    assert "holds KV heads 1-1 of 2" in (rank1.head_slice_problem(range(0, 2), "there") or "")
    assert "not have" in (dataclasses.replace(rank1, first_kv_head=2).problem() or "")


# -- groups of processes over gloo ---------------------------------------------------------------


@pytest.mark.slow
def test_tp2_greedy_tokens_equal_one_process_with_int8_pages(two_kv_heads):
    """Two ranks, one KV head each, each rank's pool of int8 pages (the packed CPU GEMMs on
    every rank, gloo's own all-reduce). Float32 pages: the deterministic test below."""
    changes = {"cache": CacheConfig(num_pages=64, kv_cache_dtype="int8")}
    prompts = random_prompts(4, seed=5)
    expected = greedy(tp_engine_config(two_kv_heads, 1, **changes), prompts)
    got = greedy(tp_engine_config(two_kv_heads, 2, **changes), prompts)
    assert_greedy_equal_up_to_near_ties(two_kv_heads, prompts, got, expected)


@pytest.mark.slow
def test_tp2_deterministic_mode_gives_one_process_tokens_in_any_batch(two_kv_heads):
    """Deterministic inference under TP: the all-reduce sums in rank order, so a prompt's
    tokens alone and in a batch of others are the same."""
    prompts = random_prompts(4, seed=6)
    # 1 MiB for the pool: 64 float32 pages of all heads (16 KiB each) at TP 1, and as many at
    # TP 2, where the two ranks' pages of one head each share the host's MiB.
    cache = CacheConfig(kv_cache_memory=1 << 20)
    config = tp_engine_config(two_kv_heads, 2, cache=cache, enable_deterministic_inference=True)
    engine = LLMEngine(config)
    try:
        assert engine.pool.num_pages == 64
        together = engine.generate(prompts, GREEDY)
        alone = [engine.generate([prompt], GREEDY)[0] for prompt in prompts[:2]]
    finally:
        engine.close()
    assert alone == together[:2]
    expected = greedy(tp_engine_config(two_kv_heads, 1), prompts)
    assert_greedy_equal_up_to_near_ties(two_kv_heads, prompts, together, expected)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_tp2_speculative_decoding_gives_one_process_tokens(two_kv_heads, method):
    """Rank 0 proposes (a draft model unsharded beside its shard of the target, or n-grams) and
    every rank verifies in the target's forward: the greedy tokens are those of one process
    without speculation, and proposals are accepted (the draft is the target itself)."""
    prompts = [p + p for p in random_prompts(3, seed=8)]  # repeats for the n-grams to find
    model = str(two_kv_heads) if method == "draft" else None
    speculative = SpeculativeConfig(method=method, model=model, num_speculative_tokens=3)
    accepted = metrics.SPEC_ACCEPTED._value.get()
    got = greedy(tp_engine_config(two_kv_heads, 2, speculative=speculative), prompts)
    assert metrics.SPEC_ACCEPTED._value.get() > accepted
    expected = greedy(tp_engine_config(two_kv_heads, 1), prompts)
    assert_greedy_equal_up_to_near_ties(two_kv_heads, prompts, got, expected)


@pytest.mark.slow
def test_tp4_with_replicated_kv_heads_equals_one_process(four_heads):
    """Four ranks over two KV heads (each held by two ranks), a padded vocabulary, tied head."""
    prompts = random_prompts(3, seed=7)
    expected = greedy(tp_engine_config(four_heads, 1), prompts)
    got = greedy(tp_engine_config(four_heads, 4), prompts)
    assert_greedy_equal_up_to_near_ties(four_heads, prompts, got, expected)


_HOLD_A_GROUP = """
import sys, time
from common.config import CacheConfig, EngineConfig
from common.engine.llm_engine import LLMEngine
if __name__ == "__main__":
    config = EngineConfig(model=sys.argv[1], dtype="float32", device="cpu",
                          cache=CacheConfig(num_pages=32), tensor_parallel_size=2)
    engine = LLMEngine(config)
    print(engine.followers.pids[0], flush=True)
    time.sleep(600)
"""


def _start_group(folder: Path) -> tuple[subprocess.Popen, int]:
    """A process holding a TP 2 engine, and its other rank's pid."""
    rank0 = subprocess.Popen(
        [sys.executable, "-c", _HOLD_A_GROUP, str(folder)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert rank0.stdout is not None
    return rank0, int(rank0.stdout.readline())


def _gone(pid: int, deadline_s: float) -> bool:
    """Whether ``pid`` ends within the deadline (a zombie nobody reaps yet has ended)."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.1)
    return False


@pytest.mark.slow
def test_a_dead_rank_takes_its_whole_group_down(two_kv_heads):
    """Killing rank 1 ends rank 0 (which cannot run without it); killing rank 0 ends rank 1."""
    rank0, rank1 = _start_group(two_kv_heads)
    try:
        os.kill(rank1, signal.SIGKILL)
        assert rank0.wait(timeout=60) == RANK_LOST_EXIT_CODE
    finally:
        rank0.kill()
    rank0, rank1 = _start_group(two_kv_heads)
    try:
        rank0.kill()
        rank0.wait(timeout=60)
        assert _gone(rank1, 60)
    finally:
        rank0.kill()


def test_each_rank_keeps_its_slice_of_the_cores():
    """Ranks of a CPU group split their process's cores instead of each spinning on all."""
    script = (
        "import os, torch\n"
        "from common.engine.tp_group import take_share_of_cores\n"
        "take_share_of_cores(1, 2)\n"
        "print(sorted(os.sched_getaffinity(0)), torch.get_num_threads())\n"
    )
    cores = sorted(os.sched_getaffinity(0))
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, check=True
    )
    expected = cores[len(cores) // 2 :] if len(cores) >= 2 else cores
    threads = len(expected) if len(cores) >= 2 else torch.get_num_threads()
    assert result.stdout.split() == [*str(expected).split(), str(threads)]
