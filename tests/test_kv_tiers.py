"""KV tiers below the pool, in the one-process engine: pages the pool evicted come back from
host memory or disk and give the same bits as computing them (deterministic mode: tokens and
logprobs), a worker that restarts reuses its disk tier, a sequence waiting for its pages holds
up no one, and an abort during a restore leaks no page and no pinned slot."""

from __future__ import annotations

import argparse
import dataclasses
import threading

import pytest
from determinism import sampling_params, serve
from engines import build_engine
from prometheus_client import REGISTRY
from tiny_models import build_tiny_model, random_prompts

from common.config import CacheConfig, EngineConfig, SpeculativeConfig
from common.engine.args import add_engine_args, engine_config_from_args
from common.engine.kv_tiers.mover import Job
from common.sampling_params import SamplingParams
from kernels.cpu import library as cpu_library

pytestmark = pytest.mark.skipif(not cpu_library.available(), reason="needs the C kernels")

# A pool of 12 pages of 16 tokens holds two of these 70-token prompts with their answers (five
# pages each): served one after another, each prompt's pages are evicted before it returns.
NUM_PAGES = 12
MAX_MODEL_LEN = 160
PROMPTS = random_prompts(5, seed=5, min_len=70, max_len=70)
FULL_PAGES = 69 // 16 * 16  # the prompt's pages a hit may cover (the last token is computed)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_tiny_model("qwen2-bias", tmp_path_factory.mktemp("qwen2-bias"))


def engine(folder, **knobs):
    knobs.setdefault("dtype", "float32")
    return build_engine(
        folder, deterministic=True, num_pages=NUM_PAGES, max_model_len=MAX_MODEL_LEN, **knobs
    )


def hits(tier: str) -> float:
    return REGISTRY.get_sample_value("pdserve_kv_tier_hits_total", {"tier": tier}) or 0.0


def assert_nothing_held(eng) -> None:
    assert not eng.has_unfinished
    assert eng.page_manager.num_free_pages == NUM_PAGES
    if eng.tiers.host is not None:
        assert eng.tiers.host.num_pinned() == 0


@pytest.mark.parametrize(
    "dtype, kv, host, disk",
    [
        ("float32", "auto", 1 << 20, False),
        ("float32", "auto", 0, True),
        # 12 int8 pages of 2176 bytes: a returning prompt's head pages, evicted last, are
        # still in host memory, the rest on disk only.
        ("bfloat16", "int8", 12 * 2176, True),
    ],
    ids=["host", "disk", "int8-host-and-disk"],
)
def test_restored_pages_give_the_same_tokens_and_logprobs(folder, tmp_path, dtype, kv, host, disk):
    params = sampling_params(len(PROMPTS))
    reference = serve(engine(folder, dtype=dtype, kv_cache_dtype=kv), PROMPTS, params, False)
    tiers = {"kv_offloading_size": host, "kv_offloading_dir": tmp_path if disk else None}
    eng = engine(folder, dtype=dtype, kv_cache_dtype=kv, **tiers)
    before = {tier: hits(tier) for tier in ("host", "disk")}
    assert serve(eng, PROMPTS, params, together=False) == reference
    eng.tiers.flush()
    cached: list[int] = []
    assert serve(eng, PROMPTS, params, together=False, cached_tokens=cached) == reference
    assert cached == [FULL_PAGES] * len(PROMPTS)  # every returning prompt's pages came back
    restored = {tier: hits(tier) - before[tier] for tier in ("host", "disk")}
    assert sum(restored.values()) == len(PROMPTS) * FULL_PAGES // 16
    if host:
        assert restored["host"] > 0
    if disk:
        assert restored["disk"] > 0
    assert_nothing_held(eng)
    eng.close()


def test_a_restarted_worker_reuses_its_disk_tier(folder, tmp_path):
    """A second engine over the directory the first one filled (a restart, or another worker
    sharing it) serves the prompts from its blocks, with the same answers."""
    params = sampling_params(len(PROMPTS))
    first = engine(folder, kv_offloading_dir=tmp_path)
    reference = serve(first, PROMPTS, params, together=False)
    fillers = random_prompts(3, seed=9, min_len=70, max_len=70)
    serve(first, fillers, params[:3], together=False)  # the last prompts' pages go down too
    first.close()  # finishes its writes
    second = engine(folder, kv_offloading_dir=tmp_path)
    assert len(second.tiers.disk.hashes()) >= len(PROMPTS) * FULL_PAGES // 16
    cached: list[int] = []
    assert serve(second, PROMPTS, params, together=False, cached_tokens=cached) == reference
    assert cached == [FULL_PAGES] * len(PROMPTS)
    second.close()


def gate_the_mover(eng) -> threading.Event:
    """Hold the mover on a job until the returned event is set: restores queue behind it."""
    gate = threading.Event()
    eng.tiers.mover.submit(Job(lambda job: gate.wait(60)))
    return gate


def test_a_sequence_waiting_for_its_pages_holds_up_no_one(folder):
    params = sampling_params(2)
    reference = serve(engine(folder), PROMPTS[:2], params, together=False)
    eng = engine(folder, kv_offloading_size=1 << 20)
    serve(eng, PROMPTS[:2], params, together=False)
    serve(eng, PROMPTS[2:4], sampling_params(2), together=False)  # prompts 0 and 1 go down
    gate = gate_the_mover(eng)
    eng.add_request(PROMPTS[0], params[0], request_id="returning")
    eng.add_request(PROMPTS[4], SamplingParams(max_tokens=3, ignore_eos=True), request_id="new")
    finished: set[str] = set()
    samples: list = []
    for _ in range(200):
        for out in eng.step():
            if out.request_id == "returning":
                samples.extend(out.new_samples)
            if out.finished:
                finished.add(out.request_id)
        if "new" in finished:
            break
    assert finished == {"new"}  # it ran to its end while the other's pages waited
    assert [seq.request_id for seq, _ in eng.scheduler.restoring] == ["returning"]
    gate.set()
    while eng.has_unfinished:
        for out in eng.step():
            samples.extend(out.new_samples if out.request_id == "returning" else [])
    assert tuple(s.token_id for s in samples) == reference[0].tokens
    assert tuple(s.logprob for s in samples) == reference[0].logprobs
    assert_nothing_held(eng)
    eng.close()


def test_an_abort_during_a_restore_leaks_nothing(folder):
    params = sampling_params(len(PROMPTS))
    eng = engine(folder, kv_offloading_size=1 << 20)
    reference = serve(eng, PROMPTS, params, together=False)
    gate = gate_the_mover(eng)
    eng.add_request(PROMPTS[0], params[0], request_id="aborted")
    eng.step()
    assert [seq.request_id for seq, _ in eng.scheduler.restoring] == ["aborted"]
    assert eng.tiers.host.num_pinned() == FULL_PAGES // 16
    assert eng.abort("aborted")
    assert not eng.scheduler.holds("aborted")
    # The pages the mover is to write stay out of the pool until it is done with them.
    assert eng.page_manager.num_free_pages == NUM_PAGES - FULL_PAGES // 16
    gate.set()
    for _ in range(200):
        if not eng.has_unfinished:
            break
        eng.step()
    assert_nothing_held(eng)
    # And the tier still serves the prompt, with the same answer.
    cached: list[int] = []
    assert serve(eng, PROMPTS[:1], params[:1], False, cached_tokens=cached) == reference[:1]
    assert cached == [FULL_PAGES]
    eng.close()


def misses(tier: str) -> float:
    return REGISTRY.get_sample_value("pdserve_kv_tier_misses_total", {"tier": tier}) or 0.0


def test_a_prompt_waiting_at_the_head_of_the_queue_is_one_miss(folder):
    """A prompt no tier holds is one miss however many steps it waits for room in the pool."""
    eng = engine(folder, kv_offloading_size=1 << 20)
    # Ten of the twelve pages, to its end: the 70-token prompt's five wait for it to finish.
    (long_prompt,) = random_prompts(1, seed=9, min_len=150, max_len=150)
    long_answer = SamplingParams(max_tokens=MAX_MODEL_LEN - 150, ignore_eos=True)
    eng.add_request(long_prompt, long_answer, request_id="holds the pool")
    eng.step()
    before = misses("host")
    eng.add_request(PROMPTS[1], SamplingParams(max_tokens=2, ignore_eos=True), request_id="waits")
    waited = 0
    while eng.has_unfinished and waited < 400:
        eng.step()
        waited += 1 if eng.scheduler.waiting else 0
    assert waited > 5  # it did wait at the head of the queue, step after step
    assert misses("host") - before == 1
    assert_nothing_held(eng)
    eng.close()


def test_two_sequences_wanting_the_same_pages_restore_them_once(folder):
    params = sampling_params(len(PROMPTS))
    eng = engine(folder, kv_offloading_size=1 << 20)
    reference = serve(eng, PROMPTS, params, together=False)
    gate = gate_the_mover(eng)
    before = hits("host")
    for request_id in ("a", "b"):
        eng.add_request(PROMPTS[0], params[0], request_id=request_id)
    eng.step()
    assert [r.follows for _, r in eng.scheduler.restoring] == [False, True]
    assert eng.page_manager.num_free_pages == NUM_PAGES - FULL_PAGES // 16  # one set of pages
    gate.set()
    samples: dict[str, list] = {"a": [], "b": []}
    for _ in range(400):
        if not eng.has_unfinished:
            break
        for out in eng.step():
            samples[out.request_id].extend(out.new_samples)
    for request_id in ("a", "b"):
        assert tuple(s.token_id for s in samples[request_id]) == reference[0].tokens
        assert tuple(s.logprob for s in samples[request_id]) == reference[0].logprobs
    assert hits("host") - before == FULL_PAGES // 16
    assert_nothing_held(eng)
    eng.close()


def test_the_flags_and_what_they_refuse():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    flags = "--kv-offloading-size 0.5 --kv-offloading-dir /tmp/x --kv-offloading-disk-size 2"
    args = parser.parse_args(flags.split())
    cache = engine_config_from_args(args).cache
    assert (cache.kv_offloading_size, cache.kv_offloading_dir) == (512 << 20, "/tmp/x")
    assert cache.kv_offloading_disk_size == 2 << 30
    assert not engine_config_from_args(parser.parse_args([])).cache.has_kv_tiers
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-offloading-size", "-1"])
    tiers = CacheConfig(kv_offloading_size=1 << 20)
    with pytest.raises(ValueError, match="enable-prefix-caching"):
        dataclasses.replace(tiers, enable_prefix_caching=False).validate()
    with pytest.raises(ValueError, match="-tp"):
        EngineConfig(cache=tiers, tensor_parallel_size=2).validate()
    draft = SpeculativeConfig(method="draft", model="/some/draft")
    with pytest.raises(ValueError, match="draft"):
        EngineConfig(cache=tiers, speculative=draft).validate()
