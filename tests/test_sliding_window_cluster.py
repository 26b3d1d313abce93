"""A model with a sliding window through `pdserve up`: router, prefill worker, pages shipped to
the decode worker, which gives back those behind the window as it decodes. Greedy tokens of
prompts longer than the window, and of answers past it, equal ``transformers``' (float32)."""

from __future__ import annotations

import shutil

import openai
import pytest
from cluster_harness import running_cluster, worker_metric
from tiny_models import build_tiny_model, hf_greedy, random_prompts

from common.model.default_model import ensure_default_model

pytestmark = pytest.mark.slow  # starts `pdserve up`

WINDOW = 24
NEW_TOKENS = 48


@pytest.fixture(scope="module")
def windowed_cluster(tmp_path_factory):
    """A tiny Mistral with a window of 24 that speaks the default model's tokenizer."""
    folder = build_tiny_model(
        "mistral",
        tmp_path_factory.mktemp("model") / "tiny-window",
        sliding_window=WINDOW,
        vocab_size=49152,
        max_position_embeddings=1024,
    )
    source = ensure_default_model(progress=False)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, folder / name)
    log = tmp_path_factory.mktemp("logs") / "up.log"
    flags = ("--max-model-len", "512", "--remote-prefill-min-tokens", "32", "--kv-cache-memory",
             "64MiB", "--dtype", "float32")  # fmt: skip
    with running_cluster(folder, log, *flags) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
        yield client, folder, base


@pytest.mark.parametrize("length", [80, 20], ids=["remote-prefill", "local-prefill"])
def test_greedy_tokens_through_the_cluster_equal_transformers(windowed_cluster, length):
    """80 tokens go to the prefill worker and their pages to the decode worker; 20 are
    prefilled on the decode worker itself. Either way the answer runs past the window."""
    client, folder, base = windowed_cluster
    [prompt] = random_prompts(1, seed=length, min_len=length, max_len=length)
    received = worker_metric(base, "decode", "pdserve_kv_pages_received_total")
    released = worker_metric(base, "decode", "pdserve_kv_pages_released_total")
    result = client.completions.create(
        model=folder.name,
        prompt=prompt,
        max_tokens=NEW_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    tokens = result.choices[0].model_extra["token_ids"]
    assert tokens == hf_greedy(folder, [prompt], NEW_TOKENS)[0]
    shipped = worker_metric(base, "decode", "pdserve_kv_pages_received_total") > received
    assert shipped == (length == 80)
    assert worker_metric(base, "decode", "pdserve_kv_pages_released_total") > released
