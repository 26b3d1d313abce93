"""LoRA adapters under tensor parallelism: column-parallel layers (q, k, v, gate, up) keep all of
A and their rows of B, row-parallel ones (o, down) their columns of A and all of B, so each
rank's delta lands beside its slice of the base layer's output. Greedy tokens of a TP 2 group
(two processes over gloo) for two adapters and the base in one batch equal PEFT's model under
each, in float32; the group sums row-parallel outputs in another order than one process, so
where two tokens nearly tie they may part there, both within a small gap of PEFT's best logit."""

from __future__ import annotations

import pytest
import torch
from engines import tp_engine_config
from peft import PeftModel
from tiny_loras import peft_greedy, save_tiny_lora
from tiny_models import random_prompts, save_tiny_model, tiny_llama_config
from transformers import AutoModelForCausalLM

from common.config import LoraConfig, ModelConfig
from common.engine.llm_engine import LLMEngine
from common.model.lora import _rank_part, load_adapter
from common.model.parallel import TensorParallel
from common.sampling_params import SamplingParams

NEW_TOKENS = 12
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
NEAR_TIE = 0.15


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-tp")
    base = save_tiny_model(tiny_llama_config(), root / "base")
    adapters = {
        "all": save_tiny_lora(base, root / "all", seed=1),
        "some": save_tiny_lora(
            base,
            root / "some",
            seed=2,
            rank=4,
            use_rslora=True,
            targets=["k_proj", "o_proj", "up_proj"],
        ),
    }
    return base, adapters


def test_rank_slices_of_an_adapter_make_up_the_whole_delta(case):
    """Per layer: the column-parallel deltas of the two ranks side by side, and the sum of the
    row-parallel ones, are the unsharded delta."""
    base, adapters = case
    config = ModelConfig.from_pretrained(base)
    adapter = load_adapter("all", adapters["all"], config, 16)
    for target in ("q_proj", "k_proj", "gate_proj", "o_proj", "down_proj"):
        a, b = adapter.weights[(0, target)]
        x = torch.randn(3, a.shape[1])
        whole = x @ a.t() @ b.t()
        parts = [_rank_part(target, a, b, config, TensorParallel(rank, 2)) for rank in (0, 1)]
        if target in ("o_proj", "down_proj"):
            half = a.shape[1] // 2
            summed = sum(
                x[:, r * half : (r + 1) * half] @ pa.t() @ pb.t()
                for r, (pa, pb) in enumerate(parts)
            )
            torch.testing.assert_close(summed, whole)
        else:
            joined = torch.cat([x @ pa.t() @ pb.t() for pa, pb in parts], dim=-1)
            torch.testing.assert_close(joined, whole)


@pytest.mark.slow  # spawns the second rank
def test_tp2_batch_of_adapters_and_the_base_equals_peft(case):
    base, adapters = case
    prompts = random_prompts(3, seed=13)
    names = [*adapters, None]
    batch = [(p, n) for p in prompts for n in names]
    lora = LoraConfig(
        enable_lora=True, modules={n: str(p) for n, p in adapters.items()}, max_loras=2
    )
    engine = LLMEngine(tp_engine_config(base, 2, lora=lora))
    try:
        got = engine.generate([p for p, _ in batch], GREEDY, lora_names=[n for _, n in batch])
    finally:
        engine.close()
    expected = {
        n: peft_greedy(base, adapters.get(n) if n else None, prompts, NEW_TOKENS) for n in names
    }
    for (prompt, name), ours in zip(batch, got, strict=True):
        theirs = expected[name][prompts.index(prompt)]
        if ours == theirs:
            continue
        i = next(j for j, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b)
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        if name is not None:
            model = PeftModel.from_pretrained(model, adapters[name])
        with torch.inference_mode():
            logits = model(torch.tensor([prompt + theirs[:i]])).logits[0, -1]
        gap = float(logits.max() - torch.minimum(logits[ours[i]], logits[theirs[i]]))
        assert gap < NEAR_TIE, (
            f"{name}: token {i} differs ({ours[i]} vs {theirs[i]}), {gap:.3f} apart"
        )
