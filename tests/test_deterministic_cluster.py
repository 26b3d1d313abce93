"""Deterministic inference through the whole stack: the same request gets the same tokens and
logprobs, bit for bit, sent alone or among 32 concurrent ones, prefilled remotely or on its
decode worker, over ZeroMQ or NIXL, with two workers per pool or one, with speculation, and
equal to the one-process engine (what `pdserve generate` runs)."""

from __future__ import annotations

import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from cluster_harness import tiny_chat_cluster
from optional_backends import needs_nixl

from common.config import CacheConfig, EngineConfig, SchedulerConfig
from common.engine.llm_engine import LLMEngine
from common.sampling_params import SamplingParams
from common.tokenizer import Tokenizer
from kernels.cpu import library as cpu_library

pytestmark = [
    pytest.mark.skipif(not cpu_library.available(), reason="needs the C kernels"),
    pytest.mark.slow,  # starts `pdserve up`
]

MAX_TOKENS = 12
SHARED = ("--max-model-len", "512", "--kv-cache-memory", "64MiB", "--dtype", "bfloat16",
          "--enable-deterministic-inference", "--remote-prefill-min-tokens", "48")  # fmt: skip


def make_prompts() -> list[list[int]]:
    """Token-id prompts: some under 48 tokens (prefilled on the decode worker), some over
    (prefilled by a prefill worker), two sharing a 64-token prefix."""
    generator = torch.Generator().manual_seed(5)
    prompts = [
        torch.randint(100, 40000, (n,), generator=generator).tolist() for n in (20, 35, 60, 90)
    ]
    shared = prompts[3][:64]
    return [*prompts, [*shared, 500, 501], [*shared, *range(600, 630)]]


PROMPTS = make_prompts()


def request_params(index: int) -> dict:
    """Greedy for most prompts, seeded sampling for every third."""
    if index % 3:
        return {"temperature": 0.0}
    return {"temperature": 0.9, "seed": 77 + index}


def ask(client, index: int) -> tuple[str, tuple[float, ...]]:
    result = client.completions.create(
        model="tiny-chat",
        prompt=PROMPTS[index],
        max_tokens=MAX_TOKENS,
        logprobs=2,
        extra_body={"ignore_eos": True},
        **request_params(index),
    )
    choice = result.choices[0]
    return choice.text, tuple(choice.logprobs.token_logprobs)


def one_process_answers(folder) -> list[tuple[str, tuple[float, ...]]]:
    """Each prompt alone in the one-process engine, deterministic, bf16."""
    engine = LLMEngine(
        EngineConfig(
            model=str(folder),
            dtype="bfloat16",
            device="cpu",
            cache=CacheConfig(kv_cache_memory=64 << 20),
            scheduler=SchedulerConfig(max_model_len=512),
            enable_deterministic_inference=True,
        )
    )
    tokenizer = Tokenizer(folder)
    answers = []
    for index, prompt in enumerate(PROMPTS):
        params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2,
                                **request_params(index))  # fmt: skip
        engine.add_request(prompt, params, request_id=str(index))
        samples = []
        while engine.has_unfinished:
            for output in engine.step():
                samples.extend(output.new_samples)
        answers.append(
            (tokenizer.decode([s.token_id for s in samples]), tuple(s.logprob for s in samples))
        )
    return answers


def assert_same_answers_alone_and_concurrent(client, expected) -> None:
    alone = [ask(client, i) for i in range(len(PROMPTS))]
    assert alone == expected
    indices = [i % len(PROMPTS) for i in range(32)]
    with ThreadPoolExecutor(max_workers=32) as pool:
        concurrent = list(pool.map(lambda i: ask(client, i), indices))
    assert concurrent == [expected[i] for i in indices]


@pytest.fixture(scope="module")
def two_by_two(tmp_path_factory):
    with tiny_chat_cluster(tmp_path_factory, *SHARED, "--prefill", "2", "--decode", "2") as up:
        yield up


def test_zmq_two_by_two_equals_one_process_alone_and_under_load(two_by_two):
    client, folder, base = two_by_two
    with urllib.request.urlopen(f"{base}/v1/models", timeout=10) as response:
        assert json.loads(response.read())["data"][0]["deterministic_inference"] is True
    assert_same_answers_alone_and_concurrent(client, one_process_answers(folder))


@needs_nixl
def test_nixl_with_speculation_equals_one_process(tmp_path_factory):
    flags = (*SHARED, "--kv-transfer", "nixl", "--speculative-method", "ngram",
             "--num-speculative-tokens", "3")  # fmt: skip
    with tiny_chat_cluster(tmp_path_factory, *flags) as (client, folder, _):
        assert_same_answers_alone_and_concurrent(client, one_process_answers(folder))
