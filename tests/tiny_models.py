"""Tiny random models of every supported family, saved as Hugging Face folders for the tests.

``tiny_llama_config`` is the one tiny Llama the tests start from; a test that needs another
shape overrides its fields by keyword, and ``save_tiny_model`` writes it with seeded weights.
"""

from __future__ import annotations

import json
import shutil
from functools import partial
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    OlmoeConfig,
    PretrainedConfig,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

VOCAB_SIZE = 384

# The fields every tiny model shares. A wider initialisation than the default gives peaked
# logits, so greedy tokens do not hinge on last-bit rounding; without BOS and EOS a generation
# runs to its max_tokens.
SHARED_FIELDS: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "num_hidden_layers": 2,
    "max_position_embeddings": 512,
    "initializer_range": 0.1,
    "bos_token_id": None,
    "eos_token_id": None,
    "pad_token_id": 0,
}
# The tiny Llama's shape: 4 query heads of 16 over 2 KV heads, tied embeddings.
LLAMA_FIELDS: dict[str, Any] = {
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "tie_word_embeddings": True,
}


def tiny_config(config_class: type[PretrainedConfig], **fields: Any) -> PretrainedConfig:
    """A ``config_class`` of the shared fields, ``fields`` over them."""
    return config_class(**(SHARED_FIELDS | fields))


def tiny_llama_config(**overrides: Any) -> LlamaConfig:
    """The tests' tiny Llama (``SHARED_FIELDS`` and ``LLAMA_FIELDS``), ``overrides`` over it."""
    return tiny_config(LlamaConfig, **(LLAMA_FIELDS | overrides))


def save_tiny_model(config: PretrainedConfig, folder: Path, seed: int = 0) -> Path:
    """``config`` with float32 weights drawn after ``torch.manual_seed(seed)``, saved in
    ``folder``: the same config and seed give the same weights."""
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    return folder


# name -> config factory (keyword overrides welcome). Between them: head_dim 32/64/80, GQA ratios
# 1/3/4, tied and untied embeddings, llama3 RoPE scaling, Qwen2's qkv bias, Qwen3's q/k norm,
# and the mixtures of experts: Mixtral's renormalised top-2 of 8, Qwen3-MoE's top-4 of 8 with
# a dense first layer, Qwen2-MoE's shared expert, OLMoE's whole-projection q/k norms and clip.
FAMILIES = {
    "llama3-rope": partial(
        tiny_llama_config,
        num_attention_heads=2,
        head_dim=32,
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
    "qwen2-bias": partial(
        tiny_config,
        Qwen2Config,
        hidden_size=192,
        num_attention_heads=6,
        num_key_value_heads=2,
        intermediate_size=256,
        tie_word_embeddings=True,
    ),
    "qwen3-qknorm": partial(
        tiny_config,
        Qwen3Config,
        hidden_size=96,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=64,
        intermediate_size=192,
        tie_word_embeddings=False,
    ),
    "mistral": partial(
        tiny_config,
        MistralConfig,
        hidden_size=160,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=80,
        intermediate_size=256,
        sliding_window=None,
        tie_word_embeddings=True,
    ),
    "mixtral": partial(
        tiny_config,
        MixtralConfig,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=96,
        num_local_experts=8,
        num_experts_per_tok=2,
        sliding_window=None,
        tie_word_embeddings=False,
    ),
    "qwen3-moe": partial(
        tiny_config,
        Qwen3MoeConfig,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=128,
        moe_intermediate_size=48,
        num_experts=8,
        num_experts_per_tok=4,
        norm_topk_prob=True,
        mlp_only_layers=[0],
        tie_word_embeddings=True,
    ),
    "qwen2-moe": partial(
        tiny_config,
        Qwen2MoeConfig,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=128,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=96,
        num_experts=6,
        num_experts_per_tok=2,
        norm_topk_prob=False,
        tie_word_embeddings=False,
    ),
    "olmoe": partial(
        tiny_config,
        OlmoeConfig,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        clip_qkv=4.0,
        tie_word_embeddings=False,
    ),
}
MOE_FAMILIES = ("mixtral", "qwen3-moe", "qwen2-moe", "olmoe")


def build_tiny_model(family: str, folder: Path, seed: int = 0, **overrides: Any) -> Path:
    """``FAMILIES[family]`` (``overrides`` over it) saved in ``folder`` with seeded weights."""
    return save_tiny_model(FAMILIES[family](**overrides), folder, seed)


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


def build_tiny_chat_model(folder: Path, seed: int = 0, family: str | None = None) -> Path:
    """A tiny random model (the tiny Llama, or ``FAMILIES[family]``) that speaks the default
    model's tokenizer and chat template, so the whole HTTP path (templates, detokenization, stop
    strings) runs at the speed of a toy."""
    from common.model.default_model import ensure_default_model

    source = ensure_default_model(progress=False)
    fields: dict[str, Any] = {
        "vocab_size": 49152,
        "max_position_embeddings": 1024,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 2,
    }
    config = tiny_llama_config(**fields) if family is None else FAMILIES[family](**fields)
    save_tiny_model(config, folder, seed)
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


def default_model_with_template(folder: Path, chat_template: str) -> Path:
    """The default model's config and tokenizer in ``folder`` (no weights: for the router), its
    chat template replaced by ``chat_template``."""
    from common.model.default_model import resolve_model_path

    source = resolve_model_path(None)
    folder.mkdir(parents=True)
    for name in ("config.json", "generation_config.json", "tokenizer.json"):
        shutil.copy(source / name, folder / name)
    config = json.loads((source / "tokenizer_config.json").read_text())
    config["chat_template"] = chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder
