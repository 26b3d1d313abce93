"""Quantized checkpoints through the whole stack: router -> prefill worker -> KV handoff ->
decode worker, greedy answers equal to the same checkpoint in one process."""

from __future__ import annotations

import openai
import pytest
from cluster_harness import greedy_reference, running_cluster
from gguf import GGMLQuantizationType
from tiny_gguf import write_tiny_llama_gguf
from tiny_models import build_tiny_chat_model

from common.model.default_model import resolve_model_path
from common.model.quantization.writer import write_compressed_tensors

pytestmark = pytest.mark.slow  # each test starts `pdserve up`

# Longer than --remote-prefill-min-tokens: these prompts take the prefill worker and the handoff.
PROMPTS = [
    " ".join(f"item{i} is followed by item{i + 1}." for i in range(12)),
    "The quick brown fox jumps over the lazy dog, and then " * 3,
]
FLAGS = ("--max-model-len", "512", "--remote-prefill-min-tokens", "16", "--kv-cache-memory",
         "64MiB", "--dtype", "float32")  # fmt: skip


def _answers_equal_one_process(folder, log, *flags: str, model=None) -> None:
    """``model``: what `pdserve up --model` is given (default ``folder``)."""
    generate, tokenizer = greedy_reference(folder)
    with running_cluster(model or folder, log, *FLAGS, *flags) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
        for prompt in PROMPTS:
            prompt_ids = tokenizer.encode(prompt)
            expected = generate(prompt_ids, 16)
            result = client.completions.create(
                model=folder.name, prompt=prompt, max_tokens=16, temperature=0
            )
            assert result.choices[0].text == tokenizer.decode(expected)
            assert result.usage.completion_tokens == len(expected)


@pytest.mark.parametrize("scheme", ["W4A16", "FP8_DYNAMIC", "W8A8"])
def test_compressed_tensors_through_the_cluster(tmp_path, scheme):
    base = build_tiny_chat_model(tmp_path / "tiny-chat")
    folder = write_compressed_tensors(base, tmp_path / f"tiny-{scheme}", scheme, group_size=32)
    _answers_equal_one_process(folder, tmp_path / "up.log", "--quantization", "compressed-tensors")


def test_gguf_file_through_the_cluster(tmp_path):
    """`pdserve up --model FILE.gguf`: the launcher writes the file's metadata folder (without
    loading torch) and every process serves it."""
    path = write_tiny_llama_gguf(tmp_path / "tiny.Q4_K.gguf", GGMLQuantizationType.Q4_K)
    folder = resolve_model_path(path)
    _answers_equal_one_process(folder, tmp_path / "up.log", model=path)
