"""Config fields that change a model's arithmetic and that pdserve implements at one value only.

A config that sets one of them otherwise is refused at load, naming the field: served as if
the field were absent, the model would answer, and answer wrongly. Fields that only matter to
training (``router_aux_loss_coef``, ``router_jitter_noise``, dropout) or that pdserve reads
(RoPE, windows, experts, biases and norms of the supported families) are not listed. Torch-free:
the router loads configs as the workers do.
"""

from __future__ import annotations

from typing import Any

# field -> the values pdserve computes as the config means (absent is always fine).
_ONLY_VALUES: dict[str, tuple[Any, ...]] = {
    "hidden_act": ("silu",),
    "hidden_activation": ("silu",),
    "mlp_bias": (False,),
    "partial_rotary_factor": (1, 1.0),
    "attn_logit_softcapping": (None,),
    "final_logit_softcapping": (None,),
    "logits_scaling": (None, 1, 1.0),
    "embedding_multiplier": (None, 1, 1.0),
    "residual_multiplier": (None, 1, 1.0),
    "attention_multiplier": (None,),
    "use_qk_norm": (None, False),
    "pretraining_tp": (None, 1),
    # Expert routing other than softmax top-k (DeepSeek's, gpt-oss's fields).
    "scoring_func": (None, "softmax"),
    "topk_method": (None, "greedy"),
    "routed_scaling_factor": (None, 1, 1.0),
    "n_shared_experts": (None, 0),
    "n_group": (None, 1),
    "topk_group": (None, 1),
    "first_k_dense_replace": (None, 0),
    "moe_layer_freq": (None, 1),
}

# Fields one family reads and another would ignore.
_FAMILY_FIELDS: dict[str, tuple[str, ...]] = {
    # o_proj's bias as well as q/k/v's: the loader's fused projections hold q/k/v's only.
    "attention_bias": ("qwen2", "qwen2_moe"),
    "clip_qkv": ("olmoe",),
    "shared_expert_intermediate_size": ("qwen2_moe",),
}


def refuse_unimplemented_fields(raw: dict[str, Any], family: str) -> None:
    """Raise ``ValueError`` naming the first field of config ``raw`` (of ``family``) whose value
    pdserve would not compute as the config means."""
    for name, values in _ONLY_VALUES.items():
        if name in raw and raw[name] not in values:
            raise ValueError(
                f"the config's {name} = {raw[name]!r} is not implemented by pdserve "
                f"(it serves {_shown(values)} only); refusing the model rather than serving it "
                "wrongly"
            )
    for name, families in _FAMILY_FIELDS.items():
        value = raw.get(name)
        if value not in (None, False, 0) and family not in families:
            raise ValueError(
                f"the config's {name} = {value!r} is not implemented for {family} models by "
                "pdserve; refusing the model rather than serving it wrongly"
            )


def _shown(values: tuple[Any, ...]) -> str:
    return " or ".join("absent" if v is None else repr(v) for v in values)
