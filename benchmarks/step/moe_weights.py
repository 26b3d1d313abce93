"""What a mixture of experts' step multiplies: its weights, counting only the experts chosen.

A dense model's decode step reads every weight and its prefill multiplies every weight by every
token; a mixture's reads and multiplies, per sparse layer, only the experts its tokens chose.
Counted from the config, not from the modules: kernels hold weights in forms of their own (the
CPU's packed tiles, CUDA's stacked experts), not as parameters.
"""

from __future__ import annotations

from common.config import ModelConfig


def weight_bytes(config: ModelConfig, itemsize: float, experts_per_layer: list[float]) -> float:
    """Bytes a decode step reads of the weights: each layer's attention, router and dense or
    shared MLP, ``experts_per_layer[i]`` experts of each sparse layer in turn, and the head."""
    moe = config.moe
    assert moe is not None, "a mixture of experts' shape"
    hidden = config.hidden_size
    q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    attention = hidden * (2 * q_size + 2 * kv_size)
    expert = 3 * hidden * moe.expert_intermediate_size
    shared = 3 * hidden * moe.shared_expert_intermediate_size + hidden
    total = float(config.vocab_size * hidden)  # the head
    sparse = iter(experts_per_layer)
    for layer in range(config.num_layers):
        total += attention
        if moe.is_sparse(layer):
            total += moe.num_experts * hidden + shared + next(sparse) * expert
        else:
            total += 3 * hidden * config.intermediate_size
    return total * itemsize
