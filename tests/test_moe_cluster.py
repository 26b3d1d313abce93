"""A mixture of experts through the whole stack: router -> prefill worker (TP 1) -> KV pages ->
decode worker of tensor-parallel size 2 with expert parallelism, greedy tokens equal to the
one-process engine's (float32), and the pages really moved.

The decode ranks each hold half the experts whole, the prefill worker all of them, so the same
tokens on both sides also check that expert parallelism computes the layer the unsplit model
does. Its sums run in another order (each rank's experts, then the all-reduce), which in float32
on the tiny model's peaked logits changes no token, as for the dense tensor-parallel clusters.
"""

from __future__ import annotations

import pytest
from cluster_harness import tiny_chat_cluster, worker_metric

from common.config import EngineConfig, SchedulerConfig
from common.engine.llm_engine import LLMEngine
from common.sampling_params import SamplingParams
from common.tokenizer import Tokenizer

# Longer than --remote-prefill-min-tokens, so they take the prefill worker.
PROMPTS = [
    " ".join(f"item{i} is followed by item{i + 1}." for i in range(12)),
    " ".join(f"step {i}: add {i * 7 % 13} to the total;" for i in range(20)),
]
MAX_TOKENS = 12
MAX_MODEL_LEN = 256
RECEIVED = "pdserve_kv_pages_received_total"


@pytest.mark.slow  # a router, a prefill worker and a decode worker of two ranks
def test_a_mixture_served_with_expert_parallel_decode_answers_as_one_process(tmp_path_factory):
    flags = ("--max-model-len", str(MAX_MODEL_LEN), "--remote-prefill-min-tokens", "32",
             "--kv-cache-memory", "16MiB", "--dtype", "float32", "--kv-transfer", "zmq",
             "--max-num-batched-tokens", "96", "--decode-tp", "2", "--enable-expert-parallel",
             "--kv-fetch-timeout", "20")  # fmt: skip
    with tiny_chat_cluster(tmp_path_factory, *flags, family="qwen2-moe") as (client, folder, base):
        tokenizer = Tokenizer(folder)
        engine = LLMEngine(
            EngineConfig(model=str(folder), dtype="float32", device="cpu",
                         scheduler=SchedulerConfig(max_model_len=MAX_MODEL_LEN))
        )  # fmt: skip
        prompts = [tokenizer.encode(prompt) for prompt in PROMPTS]
        greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
        expected = [engine.generate([prompt], greedy)[0] for prompt in prompts]
        for prompt, tokens in zip(PROMPTS, expected, strict=True):
            result = client.completions.create(
                model="tiny-chat", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0
            )
            assert result.choices[0].text == tokenizer.decode(tokens)
        assert worker_metric(base, "decode", RECEIVED) >= 2
