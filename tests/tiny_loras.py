"""Tiny random LoRA adapters made by PEFT over the tests' tiny models, and PEFT's own greedy
tokens under each: what pdserve's adapters are checked against.

``init_lora_weights=False`` draws B as well as A, so every adapter changes the model's tokens.
"""

from __future__ import annotations

from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def save_tiny_lora(
    base: Path,
    folder: Path,
    seed: int,
    rank: int = 8,
    alpha: float = 16,
    targets: list[str] | None = None,
    **config: object,
) -> Path:
    """A PEFT adapter over the model in ``base``, its weights drawn after
    ``torch.manual_seed(seed)``, saved in ``folder`` (adapter_config.json and
    adapter_model.safetensors)."""
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    torch.manual_seed(seed)
    lora = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=targets or ALL_TARGETS,
        init_lora_weights=False,
        task_type="CAUSAL_LM",
        **config,  # type: ignore[arg-type]
    )
    peft_model = get_peft_model(model, lora)
    with torch.no_grad():  # PEFT's draw is small: widen it so each adapter moves the logits
        for name, parameter in peft_model.named_parameters():
            if "lora_" in name:
                parameter.mul_(4.0)
    peft_model.save_pretrained(folder)
    return folder


def peft_greedy(
    base: Path, adapter: Path | None, prompts: list[list[int]], max_new_tokens: int
) -> list[list[int]]:
    """Greedy tokens of ``base`` under ``adapter`` by PEFT (nothing merged; None: the base)."""
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    model.eval()
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            generated = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
            outputs.append(generated[0, len(prompt) :].tolist())
    return outputs
