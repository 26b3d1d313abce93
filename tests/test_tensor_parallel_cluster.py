"""`pdserve up --prefill-tp 2 --decode-tp 2`: each worker a group of two processes over gloo, one
worker to the router, answers equal to the one-process engine's.

KV pages do not move between tensor-parallel workers yet: the handshake refuses a pool that
holds a slice of the model's KV heads (``KVLayout.mismatch``), the fetch fails, and the decode
worker prefills the prompt itself, as after any failed fetch. The test pins that down: right
tokens, no pages received, the refusal named in the log.
"""

from __future__ import annotations

import json
import urllib.request

import pytest
from cluster_harness import greedy_reference, tiny_chat_cluster, worker_metric

from common.engine_args import engine_config_from_args
from decode_worker.worker import build_parser as decode_parser
from pdserve.launcher import build_parser as build_up_parser
from pdserve.launcher import role_flags
from prefill_worker.worker import build_parser as prefill_parser

# Longer than --remote-prefill-min-tokens, so it takes the prefill worker.
LONG_PROMPT = " ".join(f"item{i} is followed by item{i + 1}." for i in range(12))
SHORT_PROMPT = "Hello there"


def test_up_gives_each_role_its_tensor_parallel_size():
    args, _ = build_up_parser().parse_known_args(["--prefill-tp", "2", "--decode-tp", "4"])
    for role, parser, size in (("prefill", prefill_parser, 2), ("decode", decode_parser, 4)):
        flags = role_flags(args, role)
        assert flags[:2] == ["--tensor-parallel-size", str(size)]
        parsed = parser().parse_args(["--router", "tcp://127.0.0.1:1", "--model", "m", *flags])
        assert engine_config_from_args(parsed).tensor_parallel_size == size


@pytest.mark.slow  # starts `pdserve up` and five processes
def test_tp2_workers_answer_as_one_process(tmp_path_factory):
    flags = ("--max-model-len", "256", "--remote-prefill-min-tokens", "32", "--kv-cache-memory",
             "16MiB", "--dtype", "float32", "--prefill-tp", "2", "--decode-tp", "2",
             "--kv-fetch-timeout", "20")  # fmt: skip
    with tiny_chat_cluster(tmp_path_factory, *flags) as (client, folder, base):
        with urllib.request.urlopen(f"{base}/v1/workers", timeout=10) as response:
            workers = json.loads(response.read())
        assert (len(workers["prefill"]), len(workers["decode"])) == (1, 1)
        generate, tokenizer = greedy_reference(folder)
        for prompt in (LONG_PROMPT, SHORT_PROMPT):
            expected = generate(tokenizer.encode(prompt), 12)
            result = client.completions.create(
                model="tiny-chat", prompt=prompt, max_tokens=12, temperature=0
            )
            assert result.choices[0].text == tokenizer.decode(expected)
        assert worker_metric(base, "decode", "pdserve_kv_pages_received_total") == 0
    logs = tmp_path_factory.getbasetemp().glob("logs*/up.log")
    newest = max(logs, key=lambda path: path.stat().st_mtime)
    assert "(a tensor-parallel rank's)" in newest.read_text()
