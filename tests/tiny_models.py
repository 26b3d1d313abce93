"""Tiny random models of every supported family, saved as Hugging Face folders for the tests."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
)

VOCAB_SIZE = 384

# name -> config. Between them: head_dim 32/64/80, GQA ratios 1/3/4, tied and untied embeddings,
# llama3 RoPE scaling, Qwen2's qkv bias, Qwen3's q/k norm. A wider initialisation than the
# default gives peaked logits, so greedy tokens do not hinge on last-bit rounding.
FAMILIES = {
    "llama3-rope": lambda: LlamaConfig(
        hidden_size=64,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=128,
        num_hidden_layers=2,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 50000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        tie_word_embeddings=False,
    ),
    "qwen2-bias": lambda: Qwen2Config(
        hidden_size=192,
        num_attention_heads=6,
        num_key_value_heads=2,
        intermediate_size=256,
        num_hidden_layers=2,
        tie_word_embeddings=True,
    ),
    "qwen3-qknorm": lambda: Qwen3Config(
        hidden_size=96,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=64,
        intermediate_size=192,
        num_hidden_layers=2,
        tie_word_embeddings=False,
    ),
    "mistral": lambda: MistralConfig(
        hidden_size=160,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=80,
        intermediate_size=256,
        num_hidden_layers=2,
        sliding_window=None,
        tie_word_embeddings=True,
    ),
}


def build_tiny_model(family: str, folder: Path, seed: int = 0) -> Path:
    config = FAMILIES[family]()
    config.vocab_size = VOCAB_SIZE
    config.max_position_embeddings = 512
    config.initializer_range = 0.1
    config.eos_token_id = None
    config.bos_token_id = None
    config.pad_token_id = 0
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder)
    return folder


def random_prompts(count: int, seed: int, min_len: int = 5, max_len: int = 40) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (count,), generator=generator).tolist()
    return [
        torch.randint(1, VOCAB_SIZE, (length,), generator=generator).tolist() for length in lengths
    ]


def hf_greedy(folder: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            generated = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
            outputs.append(generated[0, len(prompt) :].tolist())
    return outputs


def build_tiny_chat_model(folder: Path, seed: int = 0) -> Path:
    """A tiny random Llama that speaks the default model's tokenizer and chat template, so the
    whole HTTP path (templates, detokenization, stop strings) runs at the speed of a toy."""
    import shutil

    from common.model.default_model import ensure_default_model

    source = ensure_default_model(progress=False)
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        num_hidden_layers=2,
        max_position_embeddings=1024,
        initializer_range=0.1,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, folder / name)
    return folder


def assert_greedy_equal_up_to_near_ties(
    folder: Path,
    prompts: list[list[int]],
    got: list[list[int]],
    expected: list[list[int]],
    tolerance: float = 0.15,
) -> None:
    """bf16 paths that sum in different orders round differently, and where two tokens' logits
    nearly tie that can flip greedy's choice (which processor, and so which kernels, runs the
    test decides where). Each sequence must equal the expected one up to its first difference,
    and there both tokens must be within ``tolerance`` of the best logit by transformers in fp32.
    """
    model = None
    for prompt, ours, theirs in zip(prompts, got, expected, strict=True):
        assert len(ours) == len(theirs)
        if ours == theirs:
            continue
        model = model or AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        i = next(j for j, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b)
        with torch.inference_mode():
            logits = model(torch.tensor([prompt + theirs[:i]])).logits[0, -1]
        gap = float(logits.max() - torch.minimum(logits[ours[i]], logits[theirs[i]]))
        assert gap < tolerance, f"token {i} differs ({ours[i]} vs {theirs[i]}) {gap:.3f} apart"
