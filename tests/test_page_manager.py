"""The page manager's books: no leaked page, no double free, exact prefix-cache events."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.config import SchedulerConfig
from common.engine.page_manager import PageManager
from common.engine.scheduler import DecodeScheduler
from common.engine.sequence import Sequence
from common.hashing import hash_page, page_hashes
from common.sampling_params import SamplingParams

PAGE = 4


def test_hash_chain_depends_on_every_earlier_token():
    base = page_hashes(list(range(12)), PAGE)
    changed = page_hashes([99, *range(1, 12)], PAGE)
    assert len(base) == 3
    assert all(a != b for a, b in zip(base, changed, strict=True))
    assert page_hashes(list(range(14)), PAGE) == base  # a partial tail page has no hash
    assert base[1] == hash_page(base[0], [4, 5, 6, 7])


def cache_prompt(manager: PageManager, tokens: list[int]) -> list[int]:
    pages = manager.allocate(len(tokens) // PAGE)
    for index, page_hash in enumerate(page_hashes(tokens, PAGE)):
        manager.cache_page(pages[index], page_hash, tokens[index * PAGE : (index + 1) * PAGE])
    return pages


def test_prefix_hit_requires_matching_tokens_and_reports_events():
    manager = PageManager(8, PAGE)
    tokens = list(range(12))
    pages = cache_prompt(manager, tokens)
    assert manager.drain_events().stored == page_hashes(tokens, PAGE)
    assert manager.match_prefix([*range(8), 50, 51, 52, 53]) == pages[:2]
    assert manager.match_prefix(tokens, max_pages=1) == pages[:1]
    manager.free(pages)
    assert manager.num_free_pages == 8
    # Free but cached: still found, and taking it back removes it from the free pool.
    assert manager.match_prefix(tokens) == pages
    manager.acquire(pages[:2])
    assert manager.num_free_pages == 6


def test_eviction_prefers_never_cached_pages_then_least_recently_freed():
    manager = PageManager(6, PAGE)
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
    assert manager.drain_events().removed == list(reversed(page_hashes(list(range(8)), PAGE)))
    assert manager.match_prefix(list(range(100, 108))) == second


def test_allocate_beyond_capacity_raises():
    manager = PageManager(2, PAGE)
    manager.allocate(2)
    with pytest.raises(MemoryError):
        manager.allocate(1)


def test_duplicate_content_keeps_one_cached_copy():
    manager = PageManager(4, PAGE)
    tokens = list(range(4))
    [a] = manager.allocate(1)
    [b] = manager.allocate(1)
    [page_hash] = page_hashes(tokens, PAGE)
    assert manager.cache_page(a, page_hash, tokens) == a
    assert manager.cache_page(b, page_hash, tokens) == a
    assert manager.num_cached_pages() == 1


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from(["alloc", "free", "share", "cache"]), st.integers(0, 50)))
)
def test_random_allocate_free_share_never_leaks_or_double_frees(ops):
    manager = PageManager(16, PAGE)
    held: list[int] = []  # one entry per reference we hold
    for op, arg in ops:
        if op == "alloc":
            count = arg % 4 + 1
            if count <= manager.num_free_pages:
                held += manager.allocate(count)
        elif op == "free" and held:
            manager.free([held.pop(arg % len(held))])
        elif op == "share" and held:
            page = held[arg % len(held)]
            manager.acquire([page])
            held.append(page)
        elif op == "cache" and held:
            page = held[arg % len(held)]
            tokens = [arg, arg + 1, arg + 2, arg + 3]
            manager.cache_page(page, hash_page(None, tokens), tokens)
        # The books balance after every operation.
        for page in range(16):
            assert manager.ref_count(page) == held.count(page)
        assert manager.num_free_pages == 16 - len(set(held))
        hits = manager.match_prefix([arg, arg + 1, arg + 2, arg + 3])
        assert len(hits) <= 1
    manager.free(held)
    assert manager.num_free_pages == 16
    with pytest.raises(AssertionError):
        manager.free([0])


def test_decode_scheduler_reserves_pages_for_shipped_prompts_and_admits_or_returns_them():
    manager = PageManager(num_pages=8, page_size=4, enable_prefix_caching=True)
    scheduler = DecodeScheduler(SchedulerConfig(max_num_batched_tokens=64), manager, 64, [])
    assert scheduler.reserve(0) is None
    assert scheduler.reserve(33) is None  # nine pages of eight
    pages = scheduler.reserve(10)
    assert len(pages) == 3 and manager.num_free_pages == 5
    scheduler.drop_reservation(pages)
    assert manager.num_free_pages == 8
    # Admitted with its prompt computed: the first step decodes the token after it.
    seq = Sequence.from_prompt("r", list(range(10)), SamplingParams(max_tokens=4))
    seq.token_ids.append(99)  # the first token, sampled by the prefill worker
    scheduler.admit_prefilled(seq, scheduler.reserve(10))
    [item] = scheduler.schedule()
    assert item.num_new_tokens == 1 and seq.num_computed_tokens == 10
    # A prompt the scheduler cannot take gives its pages back.
    too_long = Sequence.from_prompt("x", list(range(64)), SamplingParams(max_tokens=4))
    free = manager.num_free_pages
    reserved = manager.allocate(1)
    with pytest.raises(ValueError, match="maximum model length"):
        scheduler.admit_prefilled(too_long, reserved)
    assert manager.num_free_pages == free and too_long.page_ids == []


def test_admission_hashes_the_prompt_once_and_keeps_the_hits_hashes(monkeypatch):
    """A prompt whose first pages are cached: ``match_prefix`` hashes each of them once, and the
    sequence takes those hashes from the pages instead of hashing its prompt a second time."""
    import common.hashing as hashing_module
    from common.engine.scheduler import Scheduler

    manager = PageManager(num_pages=8, page_size=PAGE, enable_prefix_caching=True)
    prompt = list(range(100, 114))  # three full pages and two tokens
    hashes = page_hashes(prompt, PAGE)
    cached = manager.allocate(2)
    for index, page_id in enumerate(cached):
        manager.cache_page(page_id, hashes[index], prompt[index * PAGE : (index + 1) * PAGE])
    manager.free(cached)
    calls = []

    def counting(parent, token_ids, namespace=""):
        calls.append(tuple(token_ids))
        return hash_page(parent, token_ids, namespace)

    # Every hash in pdserve goes through common/hashing.py's hash_page.
    monkeypatch.setattr(hashing_module, "hash_page", counting)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64), manager, 64, [])
    seq = Sequence.from_prompt("r", prompt, SamplingParams(max_tokens=4))
    scheduler.add(seq)
    [item] = scheduler.schedule()
    assert seq.page_ids[:2] == cached and seq.num_computed_tokens == 2 * PAGE
    assert item.num_new_tokens == len(prompt) - 2 * PAGE
    assert seq.page_hashes == hashes[:2]
    # The third page is looked up and missed; no page is hashed twice.
    assert calls == [tuple(prompt[i * PAGE : (i + 1) * PAGE]) for i in range(3)]


def test_namespaces_start_separate_chains_and_the_base_namespace_is_unchanged():
    tokens = list(range(12))
    base = page_hashes(tokens, PAGE)
    assert page_hashes(tokens, PAGE, namespace="") == base
    adapter = page_hashes(tokens, PAGE, namespace="lora:sql")
    other = page_hashes(tokens, PAGE, namespace="lora:chat")
    assert len({*base, *adapter, *other}) == 9  # no page of one chain equals any of another
    # A later page inherits its namespace from its parent.
    assert adapter[1] == hash_page(adapter[0], tokens[4:8])
    # Continuing a chain from a parent equals hashing the whole prefix at once.
    assert page_hashes(tokens[4:], PAGE, adapter[0], "lora:sql") == adapter[1:]


def test_sequences_of_different_namespaces_never_share_pages():
    from common.engine.scheduler import Scheduler

    manager = PageManager(num_pages=16, page_size=PAGE, enable_prefix_caching=True)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64), manager, 64, [])
    prompt = list(range(100, 113))  # three full pages and a token

    def admit(request_id, namespace):
        seq = Sequence.from_prompt(request_id, prompt, SamplingParams(max_tokens=4))
        seq.cache_namespace = namespace
        scheduler.add(seq)
        scheduler.schedule()
        seq.num_computed_tokens = len(prompt)  # as if the step ran
        scheduler._cache_full_pages(seq)
        return seq

    first = admit("a", "lora:sql")
    assert first.page_hashes == page_hashes(prompt, PAGE, namespace="lora:sql")
    other = admit("b", "")
    assert other.num_cached_tokens == 0 and not set(other.page_ids) & set(first.page_ids)
    same = admit("c", "lora:sql")
    assert same.num_cached_tokens == 3 * PAGE and same.page_ids[:3] == first.page_ids[:3]
