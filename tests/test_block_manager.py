"""The block manager's books: no leaked page, no double free, exact prefix-cache events."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.config import SchedulerConfig
from common.engine.block_manager import BlockManager
from common.engine.scheduler import DecodeScheduler
from common.engine.sequence import Sequence
from common.hashing import block_hashes, hash_block
from common.sampling_params import SamplingParams

BLOCK = 4


def test_hash_chain_depends_on_every_earlier_token():
    base = block_hashes(list(range(12)), BLOCK)
    changed = block_hashes([99, *range(1, 12)], BLOCK)
    assert len(base) == 3
    assert all(a != b for a, b in zip(base, changed, strict=True))
    assert block_hashes(list(range(14)), BLOCK) == base  # a partial tail block has no hash
    assert base[1] == hash_block(base[0], [4, 5, 6, 7])


def cache_prompt(manager: BlockManager, tokens: list[int]) -> list[int]:
    blocks = manager.allocate(len(tokens) // BLOCK)
    for index, block_hash in enumerate(block_hashes(tokens, BLOCK)):
        manager.cache_block(blocks[index], block_hash, tokens[index * BLOCK : (index + 1) * BLOCK])
    return blocks


def test_prefix_hit_requires_matching_tokens_and_reports_events():
    manager = BlockManager(8, BLOCK)
    tokens = list(range(12))
    blocks = cache_prompt(manager, tokens)
    assert manager.drain_events().stored == block_hashes(tokens, BLOCK)
    assert manager.match_prefix([*range(8), 50, 51, 52, 53]) == blocks[:2]
    assert manager.match_prefix(tokens, max_blocks=1) == blocks[:1]
    manager.free(blocks)
    assert manager.num_free_blocks == 8
    # Free but cached: still found, and taking it back removes it from the free pool.
    assert manager.match_prefix(tokens) == blocks
    manager.acquire(blocks[:2])
    assert manager.num_free_blocks == 6


def test_eviction_prefers_never_cached_pages_then_least_recently_freed():
    manager = BlockManager(6, BLOCK)
    first = cache_prompt(manager, list(range(8)))
    second = cache_prompt(manager, list(range(100, 108)))
    plain = manager.allocate(2)
    manager.drain_events()
    manager.free(first)
    manager.free(second)
    manager.free(plain)
    assert set(manager.allocate(2)) == set(plain)
    assert not manager.drain_events()
    manager.allocate(2)  # evicts `first`, freed before `second`
    assert manager.drain_events().removed == list(reversed(block_hashes(list(range(8)), BLOCK)))
    assert manager.match_prefix(list(range(100, 108))) == second


def test_allocate_beyond_capacity_raises():
    manager = BlockManager(2, BLOCK)
    manager.allocate(2)
    with pytest.raises(MemoryError):
        manager.allocate(1)


def test_duplicate_content_keeps_one_cached_copy():
    manager = BlockManager(4, BLOCK)
    tokens = list(range(4))
    [a] = manager.allocate(1)
    [b] = manager.allocate(1)
    [block_hash] = block_hashes(tokens, BLOCK)
    assert manager.cache_block(a, block_hash, tokens) == a
    assert manager.cache_block(b, block_hash, tokens) == a
    assert manager.num_cached_blocks() == 1


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from(["alloc", "free", "share", "cache"]), st.integers(0, 50)))
)
def test_random_allocate_free_share_never_leaks_or_double_frees(ops):
    manager = BlockManager(16, BLOCK)
    held: list[int] = []  # one entry per reference we hold
    for op, arg in ops:
        if op == "alloc":
            count = arg % 4 + 1
            if count <= manager.num_free_blocks:
                held += manager.allocate(count)
        elif op == "free" and held:
            manager.free([held.pop(arg % len(held))])
        elif op == "share" and held:
            block = held[arg % len(held)]
            manager.acquire([block])
            held.append(block)
        elif op == "cache" and held:
            block = held[arg % len(held)]
            tokens = [arg, arg + 1, arg + 2, arg + 3]
            manager.cache_block(block, hash_block(None, tokens), tokens)
        # The books balance after every operation.
        for block in range(16):
            assert manager.ref_count(block) == held.count(block)
        assert manager.num_free_blocks == 16 - len(set(held))
        hits = manager.match_prefix([arg, arg + 1, arg + 2, arg + 3])
        assert len(hits) <= 1
    manager.free(held)
    assert manager.num_free_blocks == 16
    with pytest.raises(AssertionError):
        manager.free([0])


def test_decode_scheduler_reserves_pages_for_shipped_prompts_and_admits_or_returns_them():
    blocks = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    scheduler = DecodeScheduler(SchedulerConfig(max_num_batched_tokens=64), blocks, 64, [])
    assert scheduler.reserve(0) is None
    assert scheduler.reserve(33) is None  # nine pages of eight
    pages = scheduler.reserve(10)
    assert len(pages) == 3 and blocks.num_free_blocks == 5
    scheduler.drop_reservation(pages)
    assert blocks.num_free_blocks == 8
    # Admitted with its prompt computed: the first step decodes the token after it.
    seq = Sequence.from_prompt("r", list(range(10)), SamplingParams(max_tokens=4))
    seq.token_ids.append(99)  # the first token, sampled by the prefill worker
    scheduler.admit_prefilled(seq, scheduler.reserve(10))
    [item] = scheduler.schedule()
    assert item.num_new_tokens == 1 and seq.num_computed_tokens == 10
    # A prompt the scheduler cannot take gives its pages back.
    too_long = Sequence.from_prompt("x", list(range(64)), SamplingParams(max_tokens=4))
    free = blocks.num_free_blocks
    reserved = blocks.allocate(1)
    with pytest.raises(ValueError, match="maximum model length"):
        scheduler.admit_prefilled(too_long, reserved)
    assert blocks.num_free_blocks == free and too_long.block_ids == []


def test_admission_hashes_the_prompt_once_and_keeps_the_hits_hashes(monkeypatch):
    """A prompt whose first pages are cached: ``match_prefix`` hashes each of them once, and the
    sequence takes those hashes from the pages instead of hashing its prompt a second time."""
    import common.hashing as hashing_module
    from common.engine.scheduler import Scheduler

    blocks = BlockManager(num_blocks=8, block_size=BLOCK, enable_prefix_caching=True)
    prompt = list(range(100, 114))  # three full pages and two tokens
    hashes = block_hashes(prompt, BLOCK)
    cached = blocks.allocate(2)
    for index, block_id in enumerate(cached):
        blocks.cache_block(block_id, hashes[index], prompt[index * BLOCK : (index + 1) * BLOCK])
    blocks.free(cached)
    calls = []

    def counting(parent, token_ids, namespace=""):
        calls.append(tuple(token_ids))
        return hash_block(parent, token_ids, namespace)

    # Every hash in pdserve goes through common/hashing.py's hash_block.
    monkeypatch.setattr(hashing_module, "hash_block", counting)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64), blocks, 64, [])
    seq = Sequence.from_prompt("r", prompt, SamplingParams(max_tokens=4))
    scheduler.add(seq)
    [item] = scheduler.schedule()
    assert seq.block_ids[:2] == cached and seq.num_computed_tokens == 2 * BLOCK
    assert item.num_new_tokens == len(prompt) - 2 * BLOCK
    assert seq.block_hashes == hashes[:2]
    # The third page is looked up and missed; no page is hashed twice.
    assert calls == [tuple(prompt[i * BLOCK : (i + 1) * BLOCK]) for i in range(3)]


def test_namespaces_start_separate_chains_and_the_base_namespace_is_unchanged():
    tokens = list(range(12))
    base = block_hashes(tokens, BLOCK)
    assert block_hashes(tokens, BLOCK, namespace="") == base
    adapter = block_hashes(tokens, BLOCK, namespace="lora:sql")
    other = block_hashes(tokens, BLOCK, namespace="lora:chat")
    assert len({*base, *adapter, *other}) == 9  # no block of one chain equals any of another
    # A later block inherits its namespace from its parent.
    assert adapter[1] == hash_block(adapter[0], tokens[4:8])
    # Continuing a chain from a parent equals hashing the whole prefix at once.
    assert block_hashes(tokens[4:], BLOCK, adapter[0], "lora:sql") == adapter[1:]


def test_sequences_of_different_namespaces_never_share_pages():
    from common.engine.scheduler import Scheduler

    blocks = BlockManager(num_blocks=16, block_size=BLOCK, enable_prefix_caching=True)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64), blocks, 64, [])
    prompt = list(range(100, 113))  # three full pages and a token

    def admit(request_id, namespace):
        seq = Sequence.from_prompt(request_id, prompt, SamplingParams(max_tokens=4))
        seq.cache_namespace = namespace
        scheduler.add(seq)
        scheduler.schedule()
        seq.num_computed_tokens = len(prompt)  # as if the step ran
        scheduler._cache_full_blocks(seq)
        return seq

    first = admit("a", "lora:sql")
    assert first.block_hashes == block_hashes(prompt, BLOCK, namespace="lora:sql")
    other = admit("b", "")
    assert other.num_cached_tokens == 0 and not set(other.block_ids) & set(first.block_ids)
    same = admit("c", "lora:sql")
    assert same.num_cached_tokens == 3 * BLOCK and same.block_ids[:3] == first.block_ids[:3]
