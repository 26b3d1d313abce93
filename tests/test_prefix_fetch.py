"""Prefix fetches between real worker processes: a decode worker prefilling a prompt fetches the
prompt's leading pages from a prefill worker's host or disk tier (after its pool evicted them),
the prefill worker runs no step for it, and the answer is the one computing the whole prompt
gives, to the logprob (deterministic mode). A fetch of pages no longer held falls back and
gives the same answer; an abort while fetching leaks no page on either side."""

from __future__ import annotations

import urllib.request

import pytest
from tiny_models import build_tiny_model, random_prompts
from worker_harness import FakeRouter, HandoffTap

from common.hashing import page_hashes
from common.metrics import parse_exposition
from common.protocol import AbortRequest, DecodeRequest, PrefillRequest, PrefixSource
from common.sampling_params import SamplingParams
from kernels.cpu import library as cpu_library

pytestmark = pytest.mark.skipif(not cpu_library.available(), reason="needs the C kernels")

# 12 pages of 8 KiB each: a pool holds two of these prompts with their answers.
FLAGS = ("--kv-cache-memory", "192KiB", "--max-model-len", "160",
         "--enable-deterministic-inference", "--kv-lease-seconds", "1")  # fmt: skip
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0, logprobs=1)
PREFIX_PAGES = 4  # a 70-token prompt: 4 full pages before the page of its last token


def held(router: FakeRouter, worker_id: str, tier: str) -> set[int]:
    """The page hashes ``worker_id`` reported holding in ``tier`` (``device``: its pool)."""
    hashes: set[int] = set()
    for msg in router.cache_events.get(worker_id, []):
        if (msg.tier or "device") != tier:
            continue
        hashes = set(msg.stored) if msg.reset else (hashes | set(msg.stored))
        hashes -= set(msg.removed)
    return hashes


def answer(router: FakeRouter, request_id: str) -> list[tuple[int, float | None]]:
    log = router.log(request_id)
    assert not log.failures, log.failures
    ordered = sorted(log.deltas, key=lambda d: d.start_index)
    return [(s.token_id, s.logprob) for d in ordered for s in d.samples]


def steps_of(router: FakeRouter, worker_id: str) -> int:
    """The worker's step count, from a heartbeat sent after this call."""
    router.heartbeats.pop(worker_id, None)
    router.wait_for(lambda: worker_id in router.heartbeats, 30, f"a heartbeat of {worker_id}")
    return router.heartbeats[worker_id].num_steps


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A prefill worker with a host tier, one with a disk tier, a decode worker without tiers;
    for each prompt, the decode worker's own answer (computed whole), then pools that have
    all evicted the prompts: the prefill workers' into their tiers."""
    tmp_path = tmp_path_factory.mktemp("prefix_fetch")
    folder = build_tiny_model("qwen2-bias", tmp_path / "model")
    router = FakeRouter(tmp_path)
    tap = HandoffTap(router.context)
    try:
        router.start_worker("prefill", folder, *FLAGS, "--kv-offloading-size", "0.001",
                            "--worker-id", "prefill-host")  # fmt: skip
        router.start_worker("prefill", folder, *FLAGS, "--kv-offloading-dir",
                            str(tmp_path / "disk"), "--worker-id", "prefill-disk")  # fmt: skip
        router.start_worker("decode", folder, *FLAGS, "--worker-id", "decode")
        router.wait_registered(3)
        names = ("host", "disk", "gone", "abort")
        prompts = dict(zip(names, random_prompts(4, seed=11, min_len=70, max_len=70), strict=True))
        fillers = random_prompts(4, seed=12, min_len=70, max_len=70)
        for name, prompt in prompts.items():
            router.send("decode", DecodeRequest(f"whole-{name}", prompt, GREEDY))
            router.wait_finished([f"whole-{name}"])
        for worker_id, held_prompts in (("prefill-host", [prompts["host"], prompts["abort"]]),
                                        ("prefill-disk", [prompts["disk"]])):  # fmt: skip
            for index, tokens in enumerate([*held_prompts, *fillers]):
                request_id = f"{worker_id}-{index}"
                router.send(worker_id, PrefillRequest(request_id, tokens, GREEDY, "decode",
                                                      tap.endpoint))  # fmt: skip
                router.wait_for(lambda r=request_id: router.log(r).deltas, 60, request_id)
        for index, tokens in enumerate(fillers):
            router.send("decode", DecodeRequest(f"filler-{index}", tokens, GREEDY))
            router.wait_finished([f"filler-{index}"])
        for name, worker_id, tier in (("host", "prefill-host", "host"),
                                      ("abort", "prefill-host", "host"),
                                      ("disk", "prefill-disk", "disk")):  # fmt: skip
            hashes = set(page_hashes(prompts[name], 16)[:PREFIX_PAGES])
            router.wait_for(lambda h=hashes, w=worker_id, t=tier: h <= held(router, w, t)
                            and not h & held(router, w, "device"), 60,
                            f"{name}: the prompt's pages below the pool only")  # fmt: skip
        for prompt in prompts.values():
            assert not set(page_hashes(prompt, 16)) & held(router, "decode", "device")
        yield router, prompts
    finally:
        tap.close()
        router.stop()


def metrics_of(router: FakeRouter, worker_id: str) -> dict[str, float]:
    url = router.workers[worker_id].metrics_url
    return parse_exposition(urllib.request.urlopen(url, timeout=10).read().decode())


def fetch(router: FakeRouter, request_id: str, prompt: list[int], worker_id: str) -> None:
    endpoint = router.workers[worker_id].kv_endpoint
    assert endpoint is not None
    source = PrefixSource(worker_id, "zmq", endpoint, PREFIX_PAGES)
    router.send("decode", DecodeRequest(request_id, prompt, GREEDY, prefix=source))


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_a_prefix_comes_from_a_tier_without_a_prefill_step(cluster, tier):
    router, prompts = cluster
    worker_id = f"prefill-{tier}"
    steps = steps_of(router, worker_id)
    before = router.metrics("decode").get(
        f'pdserve_kv_prefix_fetched_pages_total{{tier="{tier}"}}', 0.0
    )
    fetch(router, f"fetched-{tier}", prompts[tier], worker_id)
    router.wait_finished([f"fetched-{tier}"])
    assert answer(router, f"fetched-{tier}") == answer(router, f"whole-{tier}")
    assert router.log(f"fetched-{tier}").deltas[0].num_cached_tokens == 16 * PREFIX_PAGES
    after = router.metrics("decode")[f'pdserve_kv_prefix_fetched_pages_total{{tier="{tier}"}}']
    assert after - before == PREFIX_PAGES
    assert steps_of(router, worker_id) == steps  # lent from its tier, not restored by a step
    lent = metrics_of(router, worker_id)[f'pdserve_kv_prefix_lent_pages_total{{tier="{tier}"}}']
    assert lent >= PREFIX_PAGES


def test_a_prefix_no_longer_held_is_computed_with_the_same_answer(cluster):
    router, prompts = cluster
    metric = 'pdserve_kv_prefix_fetch_fallbacks_total{reason="refused"}'
    before = router.metrics("decode").get(metric, 0.0)
    fetch(router, "fetched-gone", prompts["gone"], "prefill-host")  # it never held this one
    router.wait_finished(["fetched-gone"])
    assert answer(router, "fetched-gone") == answer(router, "whole-gone")
    assert router.log("fetched-gone").deltas[0].num_cached_tokens == 0
    assert router.metrics("decode")[metric] - before == 1


def test_an_abort_while_fetching_leaks_no_page(cluster):
    router, prompts = cluster
    fetch(router, "aborted", prompts["abort"], "prefill-host")
    router.send("decode", AbortRequest("aborted"))
    # The decode worker takes its messages in order: once this one is answered, the abort was
    # taken too.
    router.send("decode", DecodeRequest("after", prompts["gone"][:20], GREEDY))
    router.wait_finished(["after"])
    router.heartbeats.clear()
    decode, prefill = router.workers["decode"], router.workers["prefill-host"]

    def all_free() -> bool:
        beats = router.heartbeats
        return all(
            w.worker_id in beats
            and beats[w.worker_id].num_free_pages == w.num_pages
            and beats[w.worker_id].num_running + beats[w.worker_id].num_waiting == 0
            for w in (decode, prefill)
        )

    router.wait_for(all_free, 60, "every page free on both workers")
    assert not router.log("aborted").failures
    assert not router.log("aborted").finished
