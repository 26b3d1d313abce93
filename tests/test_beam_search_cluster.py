"""Beam search through `pdserve up` (router, prefill and decode workers) on a tiny model equals
beam search done by brute force with transformers in fp32: every step scores every beam's whole
next-token distribution, not only the 2 * width tokens the router asks the workers for."""

from __future__ import annotations

import json

import openai
import pytest
import torch
from beam_reference import reference_beam_search
from cluster_harness import running_cluster
from tiny_models import build_tiny_chat_model
from transformers import AutoModelForCausalLM

pytestmark = pytest.mark.slow  # starts `pdserve up`

PROMPTS = [[1, 504, 2000, 9001, 77, 3456, 12000, 88], [1, 31, 32, 33]]
WIDTH, MAX_TOKENS = 3, 5


def brute_force_beams(model, prompt, eos, width, max_tokens, penalty):
    """The reference beam search over every token of transformers' fp32 distribution."""

    @torch.inference_mode()
    def next_logprobs(sequence: list[int]) -> dict[int, float]:
        logits = model(torch.tensor([sequence])).logits[0, -1]
        return dict(enumerate(torch.log_softmax(logits.double(), dim=-1).tolist()))

    return reference_beam_search(prompt, next_logprobs, eos, width, max_tokens, penalty)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder = build_tiny_chat_model(tmp_path_factory.mktemp("beam") / "tiny-chat")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    # A random model all but never picks the real EOS: make EOS the first prompt's third most
    # likely first token instead, so beams end on it (the workers and the router read it here).
    with torch.inference_mode():
        first = model(torch.tensor([PROMPTS[0]])).logits[0, -1]
    eos = int(torch.topk(first, 3).indices[2])
    config = json.loads((folder / "config.json").read_text())
    config["eos_token_id"] = eos
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    flags = ("--max-model-len", "256", "--kv-cache-memory", "32MiB", "--dtype", "float32",
             "--remote-prefill-min-tokens", "6")  # fmt: skip
    log = tmp_path_factory.mktemp("logs") / "up.log"
    with running_cluster(folder, log, *flags) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=300)
        yield client, folder.name, model, eos


@pytest.mark.parametrize("penalty", [1.0, 0.0, 3.0])
def test_beams_equal_brute_force_beam_search_with_transformers(served, penalty):
    client, name, model, eos = served
    out = client.completions.create(
        model=name,
        prompt=PROMPTS,
        n=WIDTH,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"use_beam_search": True, "length_penalty": penalty, "return_token_ids": True},
    )
    got = [(c.token_ids, c.finish_reason, c.stop_reason) for c in out.choices]
    expected = [
        (tokens, reason, eos if reason == "stop" else None)
        for prompt in PROMPTS
        for tokens, _, reason in brute_force_beams(model, prompt, eos, WIDTH, MAX_TOKENS, penalty)
    ]
    assert got == expected
    if penalty == 1.0:  # the EOS made up above ends at least one of the answers
        assert any(reason == "stop" for _, reason, _ in got)
