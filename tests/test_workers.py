"""Prefill and decode workers as real processes on loopback, with the test playing the router."""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import signal

import msgpack
import pytest
import torch
import zmq
from optional_backends import needs_nixl
from tiny_models import build_tiny_model, random_prompts
from worker_harness import FakeRouter, HandoffTap

from common.config import CacheConfig, EngineConfig, SchedulerConfig
from common.engine.llm_engine import LLMEngine
from common.messages import encode
from common.protocol import AbortRequest, HandoffPart, Heartbeat
from common.sampling_params import SamplingParams
from common.service.worker_base import run_worker
from kernels.sizes import ceil_div

pytestmark = pytest.mark.slow  # worker processes over real sockets

GREEDY = SamplingParams(max_tokens=12, temperature=0.0)
ENGINE_FLAGS = ("--kv-cache-memory", "32MiB", "--max-model-len", "256")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_model("qwen2-bias", tmp_path_factory.mktemp("model"))


@pytest.fixture
def router(tmp_path):
    fake = FakeRouter(tmp_path)
    yield fake
    fake.stop()


PREFILL_CHUNK = 24


def one_process(model, prompts, params, dtype, kv_cache_dtype, deterministic=False):
    """Each prompt alone through the one-process engine, computed as the workers compute it: in
    prefill chunks of the prefill worker's size, on one thread (the workers' setting). In bf16
    the rounding depends on both, so only then are the tokens comparable bit for bit."""
    engine = LLMEngine(
        EngineConfig(
            model=str(model),
            dtype=dtype,
            device="cpu",
            cache=CacheConfig(kv_cache_dtype=kv_cache_dtype, num_pages=128),
            scheduler=SchedulerConfig(max_num_batched_tokens=PREFILL_CHUNK, max_model_len=256),
            enable_deterministic_inference=deterministic,
        )
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return [engine.generate([prompt], params)[0] for prompt in prompts]
    finally:
        torch.set_num_threads(threads)


def release_tapped_handoff(router, request_id: str) -> None:
    """A handoff sent to a tap is never fetched: its pages stay leased on the prefill worker, which
    told to stop would wait for them until its drain deadline. The router's abort ends the lease."""
    router.send(router.worker("prefill").worker_id, AbortRequest(request_id))


def start_pair(router, model, backend, *flags, prefill_flags=(), decode_flags=()):
    common = (*ENGINE_FLAGS, "--kv-transfer", backend, *flags)
    # Small prefill chunks: pages of earlier chunks are final before the prompt ends.
    router.start_worker(
        "prefill", model, *common, "--max-num-batched-tokens", str(PREFILL_CHUNK), *prefill_flags
    )
    router.start_worker("decode", model, *common, *decode_flags)
    router.wait_registered(2)


@pytest.mark.parametrize(
    "backend, kv_cache_dtype",
    [
        ("zmq", "auto"),
        ("zmq", "fp8"),
        ("zmq", "int8"),
        pytest.param("nixl", "auto", marks=needs_nixl),
        pytest.param("nixl", "int8", marks=needs_nixl),
    ],
)
def test_disaggregated_greedy_equals_one_process(router, model, backend, kv_cache_dtype):
    start_pair(router, model, backend, "--dtype", "bfloat16", "--kv-cache-dtype", kv_cache_dtype)
    prompts = random_prompts(4, seed=11, min_len=10, max_len=60)
    expected = one_process(model, prompts, GREEDY, "bfloat16", kv_cache_dtype)
    ids = [f"req-{i}" for i in range(len(prompts))]
    # One at a time, as the reference ran them: batch shapes change bf16 rounding.
    for request_id, prompt in zip(ids, prompts, strict=True):
        router.prefill(request_id, prompt, GREEDY)
        router.wait_finished([request_id])
    assert [router.log(r).token_ids for r in ids] == expected
    first = [next(d for d in router.log(r).deltas if d.first) for r in ids]
    assert all(
        d.start_index == 0 and d.num_prompt_tokens == len(p)
        for d, p in zip(first, prompts, strict=True)
    )
    # Between the decode worker's first token (with its stage times) and its last (with the
    # finish), every token went as a bare column entry.
    assert [router.log(r).column_tokens for r in ids] == [len(t) - 3 for t in expected]
    decode = router.metrics("decode")
    pages = sum(ceil_div(len(p), 16) for p in prompts)
    assert decode["pdserve_kv_pages_received_total"] == pages
    assert decode["pdserve_prompt_tokens_computed_total"] == 0
    assert router.metrics("prefill")["pdserve_kv_pages_sent_total"] == pages
    # Every handoff was timed, from the prefill's last chunk to the pages held here.
    assert decode["pdserve_kv_handoff_seconds_count"] == len(prompts)
    assert 0 < decode["pdserve_kv_handoff_seconds_sum"] < 60
    # Pages completed by earlier chunks came in parts, each its own fetch, before the handoff.
    fetches = f'pdserve_kv_transfer_seconds_count{{backend="{backend}",side="receiver"}}'
    assert decode[fetches] == sum(fetches_for(len(p)) for p in prompts) > len(prompts)


@pytest.mark.parametrize(
    "spec_flags",
    [
        ("--speculative-method", "ngram", "--num-speculative-tokens", "3"),
        ("--speculative-model", "TARGET", "--num-speculative-tokens", "4"),
    ],
    ids=["ngram", "draft"],
)
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_speculating_decode_worker_gives_the_same_greedy_tokens(
    router, tmp_path, spec_flags, kv_cache_dtype
):
    """Prompts prefilled remotely, decoded with speculation: the tokens are the one-process
    engine's without it, and runs of several tokens arrive in one delta. The draft is the
    target itself, so its every proposal is accepted; this tiny Llama often continues a
    repeated prompt as it went on the first time, which n-gram lookup proposes."""
    model = build_tiny_model("llama3-rope", tmp_path / "llama")
    flags = [str(model) if flag == "TARGET" else flag for flag in spec_flags]
    dtype_flags = ("--dtype", "bfloat16", "--kv-cache-dtype", kv_cache_dtype)
    start_pair(router, model, "zmq", *dtype_flags, decode_flags=flags)
    prompts = [p + p for p in random_prompts(3, seed=13, min_len=10, max_len=30)]
    params = SamplingParams(max_tokens=24, temperature=0.0)
    expected = one_process(model, prompts, params, "bfloat16", kv_cache_dtype)
    ids = [f"spec-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts, strict=True):
        router.prefill(request_id, prompt, params)
        router.wait_finished([request_id])
    assert [router.log(r).token_ids for r in ids] == expected
    assert max(len(d.samples) for r in ids for d in router.log(r).deltas) > 1
    decode = router.metrics("decode")
    assert decode["pdserve_spec_decode_accepted_tokens_total"] > 0
    assert decode["pdserve_spec_decode_accepted_tokens_per_step_count"] > 0


def test_a_decode_worker_launching_steps_ahead_gives_the_same_greedy_tokens(router, model):
    """``--async-scheduling`` on a CPU decode worker: three handed-off requests decode together
    while one stops at a token of its own and one at its length, so rows leave steps launched
    ahead. Deterministic mode (batch-invariant kernels) makes each request's tokens those of its
    run alone, whatever shares its steps; no page is left held."""
    start_pair(router, model, "zmq", "--enable-deterministic-inference",
               decode_flags=("--async-scheduling",))  # fmt: skip
    total = free_pages(router, "decode")
    prompts = random_prompts(3, seed=17, min_len=10, max_len=40)
    greedy = SamplingParams(max_tokens=24, temperature=0.0)
    free_runs = one_process(model, prompts, greedy, "float32", "auto", deterministic=True)
    params = [
        SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=[free_runs[0][6]]),
        SamplingParams(max_tokens=9, temperature=0.0),
        greedy,
    ]
    expected = [
        one_process(model, [p], sp, "float32", "auto", deterministic=True)[0]
        for p, sp in zip(prompts, params, strict=True)
    ]
    ids = [f"ahead-{i}" for i in range(len(prompts))]
    for request_id, prompt, request_params in zip(ids, prompts, params, strict=True):
        router.prefill(request_id, prompt, request_params)
    router.wait_finished(ids)
    assert [router.log(r).token_ids for r in ids] == expected
    assert router.metrics("decode")["pdserve_steps_launched_ahead_total"] > 0
    router.wait_for(lambda: free_pages(router, "decode") == total, 20, "decode pages held")


def fetches_for(prompt_len: int, chunk: int = PREFILL_CHUNK, page_size: int = 16) -> int:
    """Fetches of one handed-off prompt: a part per chunk that completed pages, then the rest."""
    fetches, shipped, computed = 1, 0, 0
    while (computed := min(computed + chunk, prompt_len)) < prompt_len:
        if computed // page_size > shipped:
            fetches, shipped = fetches + 1, computed // page_size
    return fetches


def test_first_token_that_ends_a_request_is_not_handed_off(router, model):
    start_pair(router, model, "zmq", prefill_flags=("--kv-lease-seconds", "2"))
    totals = {role: free_pages(router, role) for role in ("prefill", "decode")}
    # Long enough for parts to be shipped before the first token ends it: they are withdrawn.
    prompt = random_prompts(1, seed=3, min_len=90, max_len=90)[0]
    router.prefill("one", prompt, SamplingParams(max_tokens=1, temperature=0))
    router.wait_finished(["one"])
    [delta] = router.log("one").deltas
    assert delta.first and delta.finish_reason == "length"
    assert router.metrics("decode").get('pdserve_requests_total{outcome="length"}', 0) == 0
    for role, total in totals.items():
        router.wait_for(lambda r=role, t=total: free_pages(router, r) == t, 20, f"{role} leaks")
    assert len(router.log("one").deltas) == 1


def test_abort_during_chunked_prefill_withdraws_the_parts(router, model):
    """Aborted after its first part went out, a prompt's parts are withdrawn: their leases end
    at once (long before they would run out) and the decode worker is told to drop them."""
    start_pair(router, model, "zmq", prefill_flags=("--max-num-batched-tokens", "16"))
    total = free_pages(router, "prefill")
    tap = HandoffTap(router.context)
    prompt = random_prompts(1, seed=4, min_len=240, max_len=240)[0]
    router.prefill("short-lived", prompt, GREEDY, handoff_endpoint=tap.endpoint)
    first = tap.next(timeout=60)
    assert isinstance(first, HandoffPart) and first.part_index == 0
    # Fifteen chunks of 16: the abort lands while the prompt is still being prefilled.
    router.send(router.worker("prefill").worker_id, AbortRequest("short-lived"))
    while not isinstance(msg := tap.next(timeout=30), AbortRequest):
        assert isinstance(msg, HandoffPart), f"{type(msg).__name__} after the abort"
    router.wait_for(lambda: free_pages(router, "prefill") == total, 30, "part leases held")
    assert not router.log("short-lived").deltas
    tap.close()


def test_parts_withdrawn_by_the_prefill_worker_are_dropped(router, model):
    """Parts whose handoff never comes (the prefill worker withdrew them) free their pages, and
    the prefill worker's part leases end once the decode worker has read them."""
    start_pair(router, model, "zmq", prefill_flags=("--kv-lease-seconds", "2"))
    decode = router.worker("decode")
    totals = {role: free_pages(router, role) for role in ("prefill", "decode")}
    tap = HandoffTap(router.context)
    prompt = random_prompts(1, seed=6, min_len=100, max_len=100)[0]
    router.prefill("withdrawn", prompt, GREEDY, handoff_endpoint=tap.endpoint)
    tap.receive(timeout=60)
    parts = tap.received[:-1]
    assert len(parts) == fetches_for(len(prompt)) - 1 > 1
    push = router.context.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(decode.handoff_endpoint)
    for part in parts:
        push.send(encode(part))
    pages = sum(len(p.transfer.page_ids) for p in parts)
    router.wait_for(
        lambda: router.metrics("decode")["pdserve_kv_pages_received_total"] == pages,
        30,
        "parts not fetched",
    )
    # The parts hold the pages they brought, not the rest of the prompt they claim.
    assert free_pages(router, "decode") == totals["decode"] - pages
    assert pages < ceil_div(len(prompt), 16)
    push.send(encode(AbortRequest("withdrawn")))
    for role, total in totals.items():
        router.wait_for(lambda r=role, t=total: free_pages(router, r) == t, 20, f"{role} leaks")
    push.close()
    tap.close()


def test_local_prefill_on_the_decode_worker(router, model):
    start_pair(router, model, "zmq")
    prompt = random_prompts(1, seed=5)[0]
    router.decode_locally("local", prompt, GREEDY)
    router.wait_finished(["local"])
    assert (
        router.log("local").token_ids == one_process(model, [prompt], GREEDY, "float32", "auto")[0]
    )
    assert router.metrics("decode")["pdserve_prompt_tokens_computed_total"] == len(prompt)


def free_pages(router, role) -> int:
    worker = router.worker(role).worker_id
    router.heartbeats.pop(worker, None)
    router.wait_for(lambda: worker in router.heartbeats, 30, "no heartbeat")
    beat: Heartbeat = router.heartbeats[worker]
    return beat.num_free_pages


def test_prefill_killed_mid_transfer_decode_releases_pages_and_prefills_itself(router, model):
    start_pair(router, model, "zmq", decode_flags=("--kv-fetch-timeout", "3"))
    decode = router.worker("decode")
    total = free_pages(router, "decode")
    tap = HandoffTap(router.context)
    prompt = random_prompts(1, seed=9, min_len=40, max_len=40)[0]
    router.prefill("doomed", prompt, GREEDY, handoff_endpoint=tap.endpoint)
    tap.receive(timeout=60)
    # A 40-token prompt in chunks of 24: its first page came early, in a part.
    assert [type(m).__name__ for m in tap.received] == ["HandoffPart", "Handoff"]
    os.kill(router.processes[0].pid, signal.SIGKILL)
    router.processes[0].wait(10)
    push = router.context.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(decode.handoff_endpoint)
    tap.forward(push)
    router.wait_finished(["doomed"], timeout=60)
    assert (
        router.log("doomed").token_ids == one_process(model, [prompt], GREEDY, "float32", "auto")[0]
    )
    metrics = router.metrics("decode")
    assert metrics["pdserve_kv_transfer_fallbacks_total"] == 1
    assert metrics["pdserve_kv_pages_received_total"] == 0
    assert metrics["pdserve_prompt_tokens_computed_total"] == len(prompt)
    assert free_pages(router, "decode") == total
    push.close()
    tap.close()


def test_decode_killed_prefill_releases_pinned_pages_when_the_lease_ends(router, model):
    start_pair(router, model, "zmq", prefill_flags=("--kv-lease-seconds", "2"))
    total = free_pages(router, "prefill")
    os.kill(router.processes[1].pid, signal.SIGKILL)
    router.processes[1].wait(10)
    prompt = random_prompts(1, seed=10, min_len=50, max_len=50)[0]
    router.prefill("orphan", prompt, GREEDY)
    router.wait_for(lambda: router.log("orphan").deltas, 60, "no first token")
    # Pinned for the transfer (the prompt's pages are held, not just cached).
    assert free_pages(router, "prefill") == total - 4
    router.wait_for(
        lambda: (
            router.heartbeats.get(router.worker("prefill").worker_id)
            and free_pages(router, "prefill") == total
        ),
        15,
        "pages never released",
    )


GARBAGE = [
    b"\xc1\xc1not msgpack",
    msgpack.packb([1, 2, 3]),
    msgpack.packb({"type": "no.such.message"}),
    msgpack.packb({"type": "router.abort", "request_id": 7}),
    msgpack.packb({"type": "router.prefill", "request_id": "x"}),
    b"\x00" * (2 << 20),
]


def test_garbage_on_every_socket_is_dropped_and_counted(router, model):
    start_pair(router, model, "zmq")
    tap = HandoffTap(router.context)
    prompt = random_prompts(1, seed=12)[0]
    router.prefill("probe", prompt, GREEDY, handoff_endpoint=tap.endpoint)
    handoff = tap.receive(timeout=60)
    side_channel = handoff.transfer.endpoint
    for role in ("prefill", "decode"):
        worker_id = router.worker(role).worker_id
        for frame in GARBAGE:
            router.send_raw(worker_id, frame)
        router.send_raw(worker_id, b"two", b"frames")
    push = router.context.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(router.worker("decode").handoff_endpoint)
    for frame in GARBAGE:
        push.send(frame)
    push.send(encode(Heartbeat("w", 0, 0, 0, 0, 0.0)))  # valid, but not a handoff
    # Well-formed, but beyond what the decode worker can hold: refused before anything is
    # reserved or computed (a token id past the vocabulary once crashed it).
    out_of_range = [
        dataclasses.replace(handoff, request_id="big-id", prompt_token_ids=[10**9, *prompt]),
        dataclasses.replace(
            handoff,
            request_id="bad-first",
            first_token=dataclasses.replace(handoff.first_token, token_id=-1),
        ),
        dataclasses.replace(handoff, request_id="too-long", prompt_token_ids=[5] * 100_000),
        HandoffPart("huge-part", 0, 0, 10**9, "huge-part", handoff.transfer),
    ]
    for msg in out_of_range:
        push.send(encode(msg))
    dealer = router.context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(side_channel)
    for frame in GARBAGE:
        dealer.send(frame)
    # Both workers still serve a request end to end.
    router.prefill("after", prompt, GREEDY)
    router.wait_finished(["after"])
    assert (
        router.log("after").token_ids == one_process(model, [prompt], GREEDY, "float32", "auto")[0]
    )
    bad_router = 'pdserve_bad_messages_total{socket="router"}'
    assert router.metrics("prefill")[bad_router] == len(GARBAGE) + 1
    decode = router.metrics("decode")
    assert decode[bad_router] == len(GARBAGE) + 1
    handoff_drops = len(GARBAGE) + 1 + len(out_of_range)
    assert decode['pdserve_bad_messages_total{socket="handoff"}'] == handoff_drops
    bad_side = 'pdserve_kv_transfer_bad_messages_total{backend="zmq",side="sender"}'
    assert router.metrics("prefill")[bad_side] >= len(GARBAGE) - 1
    for sock in (push, dealer):
        sock.close()
    tap.close()
    release_tapped_handoff(router, "probe")


def test_redispatch_after_abort_with_the_same_id_is_served(router, model):
    """The router aborts a request on a worker and re-dispatches it there under the same id
    (its prefill worker was lost): the re-dispatch wins, and a late handoff is dropped."""
    start_pair(router, model, "zmq")
    decode = router.worker("decode")
    prompt = random_prompts(1, seed=21, min_len=30, max_len=30)[0]
    tap = HandoffTap(router.context)
    router.prefill("again", prompt, GREEDY, handoff_endpoint=tap.endpoint)
    tap.receive(timeout=60)
    router.wait_for(lambda: router.log("again").deltas, 30, "no first token")
    router.log("again").deltas.clear()  # the prefill worker's; the re-dispatch starts over
    router.send(decode.worker_id, AbortRequest("again"))
    router.decode_locally("again", prompt, GREEDY)
    push = router.context.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(decode.handoff_endpoint)
    tap.forward(push)  # arrives late: must not start a second copy
    router.wait_finished(["again"])
    expected = one_process(model, [prompt], GREEDY, "float32", "auto")[0]
    assert router.log("again").token_ids == expected
    router.pump(1.0)
    assert len(router.log("again").deltas) == len(expected)
    assert router.metrics("decode")["pdserve_kv_pages_received_total"] == 0
    release_tapped_handoff(router, "again")


def test_a_worker_process_freezes_what_start_up_left_before_it_serves():
    """A full collection walks every tracked object (some 500k after the imports and the model:
    a stall of a few hundred milliseconds for the whole batch); a worker moves what start-up
    left out of the collector's reach before its loop starts."""
    frozen_when_serving: list[int] = []

    class Service:
        successor = None  # no role switch: the loop ends with this role's

        def __init__(self, args: argparse.Namespace) -> None:
            self.model_objects = [[index] for index in range(10_000)]

        def serve(self) -> None:
            frozen_when_serving.append(gc.get_freeze_count())

    parser = argparse.ArgumentParser()
    parser.add_argument("--log-level", default="warning")
    assert run_worker(Service, parser, []) == 0
    assert frozen_when_serving[0] > 10_000
    assert gc.get_freeze_count() == 0  # handed back at the end, for the last collection
