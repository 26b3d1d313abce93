"""Each mixture of experts through the whole stack: router -> prefill worker (TP 1) -> KV pages
-> decode worker, greedy tokens equal to transformers' (float32), and the pages really moved.
Two families decode at TP 1, two on a decode worker of two ranks with expert parallelism.

With expert parallelism the decode ranks each hold half the experts whole, the prefill worker
all of them, so the same tokens on both sides also check that expert parallelism computes the
layer the unsplit model does. Its sums run in another order (each rank's experts, then the
all-reduce), which in float32 on the tiny model's peaked logits changes no token, as for the
dense tensor-parallel clusters.
"""

from __future__ import annotations

import pytest
from cluster_harness import tiny_chat_cluster, worker_metric
from tiny_models import hf_greedy

from common.tokenizer import Tokenizer

# Longer than --remote-prefill-min-tokens, so they take the prefill worker.
PROMPTS = [
    " ".join(f"item{i} is followed by item{i + 1}." for i in range(12)),
    " ".join(f"step {i}: add {i * 7 % 13} to the total;" for i in range(20)),
]
MAX_TOKENS = 12
MAX_MODEL_LEN = 256
RECEIVED = "pdserve_kv_pages_received_total"


@pytest.mark.slow  # a router, a prefill worker and a decode worker of one or two ranks
@pytest.mark.parametrize(
    ("family", "decode_flags"),
    [
        ("mixtral", ("--decode-tp", "2", "--enable-expert-parallel")),
        ("qwen2-moe", ("--decode-tp", "2", "--enable-expert-parallel")),
        ("qwen3-moe", ()),
        ("olmoe", ()),
    ],
)
def test_a_mixture_served_disaggregated_answers_as_transformers(
    tmp_path_factory, family, decode_flags
):
    flags = ("--max-model-len", str(MAX_MODEL_LEN), "--remote-prefill-min-tokens", "32",
             "--kv-cache-memory", "16MiB", "--dtype", "float32", "--kv-transfer", "zmq",
             "--max-num-batched-tokens", "96", "--kv-fetch-timeout", "20",
             *decode_flags)  # fmt: skip
    with tiny_chat_cluster(tmp_path_factory, *flags, family=family) as (client, folder, base):
        tokenizer = Tokenizer(folder)
        prompts = [tokenizer.encode(prompt) for prompt in PROMPTS]
        expected = hf_greedy(folder, prompts, MAX_TOKENS)
        for prompt, tokens in zip(PROMPTS, expected, strict=True):
            result = client.completions.create(
                model="tiny-chat", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0
            )
            assert result.choices[0].text == tokenizer.decode(tokens)
        assert worker_metric(base, "decode", RECEIVED) >= 2
