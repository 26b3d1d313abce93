"""The mixture-of-experts part of a model's config: how many experts, how tokens choose them,
and which layers have them. Torch-free: the router reads configs as the workers do.

Each family names the same things differently, and routes a little differently:

- Mixtral: ``num_local_experts`` experts of ``intermediate_size``, every layer; the top-k
  probabilities are always renormalised to sum to one;
- Qwen2-MoE and Qwen3-MoE: ``num_experts`` of ``moe_intermediate_size``; renormalised where
  ``norm_topk_prob``; a layer is sparse where ``(layer + 1) % decoder_sparse_step == 0`` and it
  is not in ``mlp_only_layers`` (the others keep a dense MLP of ``intermediate_size``).
  Qwen2-MoE adds a shared expert of ``shared_expert_intermediate_size`` that every token runs,
  scaled by ``sigmoid(shared_expert_gate(x))``;
- OLMoE: ``num_experts`` of ``intermediate_size``, every layer, ``norm_topk_prob``.

Routing itself is one rule for all of them (``common/model/moe.py``): softmax over the router's
logits in float32, the k largest probabilities, optionally renormalised.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# The families with experts (common/config.py's names for them).
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")


@dataclass(frozen=True, slots=True)
class MoEConfig:
    num_experts: int
    top_k: int  # experts each token runs (num_experts_per_tok)
    expert_intermediate_size: int  # one expert's MLP width
    renormalize: bool  # the top-k probabilities divided by their sum
    # Qwen2-MoE's expert that every token runs, gated by a sigmoid; 0 where there is none.
    shared_expert_intermediate_size: int
    sparse_layers: frozenset[int]  # the layers whose MLP is the experts; the rest are dense

    def is_sparse(self, layer: int) -> bool:
        return layer in self.sparse_layers


def moe_config(raw: dict[str, Any], family: str, num_layers: int) -> MoEConfig | None:
    """The experts of config ``raw`` (of ``family``), or None for a dense family. Raises
    ``ValueError`` naming the field that is missing or out of range."""
    if family not in MOE_FAMILIES:
        return None
    if family == "mixtral":
        num_experts = _field(raw, "num_local_experts")
        width = _field(raw, "intermediate_size")
        renormalize = True
    else:
        # transformers writes Qwen3-MoE's count as num_local_experts too.
        name = "num_experts" if "num_experts" in raw else "num_local_experts"
        num_experts = _field(raw, name)
        width = _field(raw, "intermediate_size" if family == "olmoe" else "moe_intermediate_size")
        renormalize = bool(raw.get("norm_topk_prob", family == "qwen3_moe"))
    top_k = _field(raw, "num_experts_per_tok")
    if top_k > num_experts:
        raise ValueError(f"num_experts_per_tok {top_k} is more than the {num_experts} experts")
    shared = 0
    if family == "qwen2_moe":
        shared = int(raw.get("shared_expert_intermediate_size") or 0)
    return MoEConfig(
        num_experts=num_experts,
        top_k=top_k,
        expert_intermediate_size=width,
        renormalize=renormalize,
        shared_expert_intermediate_size=shared,
        sparse_layers=_sparse_layers(raw, family, num_layers),
    )


def _sparse_layers(raw: dict[str, Any], family: str, num_layers: int) -> frozenset[int]:
    if family not in ("qwen2_moe", "qwen3_moe"):
        return frozenset(range(num_layers))
    step = raw.get("decoder_sparse_step", 1)
    if not isinstance(step, int) or step < 1:
        raise ValueError(f"decoder_sparse_step must be a positive integer, got {step!r}")
    dense = raw.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(isinstance(i, int) for i in dense):
        raise ValueError(f"mlp_only_layers must be a list of layer indices, got {dense!r}")
    return frozenset(i for i in range(num_layers) if (i + 1) % step == 0 and i not in dense)


def _field(raw: dict[str, Any], name: str) -> int:
    value = raw.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"the config's {name} must be a positive integer, got {value!r}")
    return value
