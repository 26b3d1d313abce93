"""Kernel sets (``kernels/layer_kernels.py``) and the layer modules that take their parts.

A set answers for each role of a decoder layer with a module, or None to keep the torch one; the
layer modules ask for their own parts, so which parts a device swaps is the set's business
alone. These tests give a model a set that marks what it hands out, and check every part went
where its role says and nothing else moved.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import build_tiny_model
from torch import nn

from common.config import ModelConfig
from common.model.llama import RMSNorm, RotaryApply
from common.model.loader import load_model
from common.model.mlp import SiluAndMul
from kernels.cpu.linear import CpuLinear, StepShape
from kernels.layer_kernels import CpuKernels, LayerKernels


class Marked(nn.Module):
    """What the marking set hands out: its role, and the weight it was given (shared)."""

    def __init__(self, role: str, weight: torch.Tensor | None = None) -> None:
        super().__init__()
        self.role = role
        self.weight = weight


class MarkingKernels(LayerKernels):
    """Answers for the roles in ``roles`` with a Marked module, None for the others."""

    def __init__(self, roles: set[str]) -> None:
        self.roles = roles
        self.step_shape = StepShape()

    def _mark(self, role: str, weight: torch.Tensor | None = None) -> nn.Module | None:
        return Marked(role, weight) if role in self.roles else None

    def linear(self, weight, bias):
        return self._mark("linear", weight)

    def norm(self, weight, eps):
        return self._mark("norm", weight)

    def head_norm(self, weight, eps):
        return self._mark("head_norm", weight)

    def rotary(self):
        return self._mark("rotary")

    def activation(self):
        return self._mark("activation")


ROLES = {"linear", "norm", "head_norm", "rotary", "activation"}


@pytest.fixture(scope="module")
def qwen3_folder(tmp_path_factory):
    """Untied embeddings and q/k norms: every role a layer has."""
    return build_tiny_model("qwen3-qknorm", tmp_path_factory.mktemp("qwen3"))


def tiny_model(folder):
    return load_model(ModelConfig.from_pretrained(str(folder)), torch.float32, torch.device("cpu"))


def parts(model) -> dict[str, nn.Module]:
    """Every swappable part of the model by its place, the output projection included."""
    found = {"norm": model.norm, "head": model.head, "lm_head": model.lm_head}
    for index, layer in enumerate(model.decoder_layers()):
        attention, mlp = layer.self_attn, layer.mlp
        for name, part in {
            "input_layernorm": layer.input_layernorm,
            "post_attention_layernorm": layer.post_attention_layernorm,
            "qkv_proj": attention.qkv_proj,
            "o_proj": attention.o_proj,
            "q_norm": attention.q_norm,
            "k_norm": attention.k_norm,
            "rotary": attention.rotary,
            "gate_up_proj": mlp.gate_up_proj,
            "down_proj": mlp.down_proj,
            "act": mlp.act,
        }.items():
            found[f"{index}.{name}"] = part
    return found


# Each place's role, by the last part of its name.
ROLE_OF = {
    "input_layernorm": "norm",
    "post_attention_layernorm": "norm",
    "norm": "norm",
    "q_norm": "head_norm",
    "k_norm": "head_norm",
    "rotary": "rotary",
    "act": "activation",
    "qkv_proj": "linear",
    "o_proj": "linear",
    "gate_up_proj": "linear",
    "down_proj": "linear",
    "head": "linear",
}


@pytest.mark.parametrize(
    "roles", [set(), {"linear"}, {"norm", "rotary"}, {"head_norm", "activation"}, ROLES]
)
def test_each_part_takes_what_the_set_hands_out_for_its_role(qwen3_folder, roles) -> None:
    model = tiny_model(qwen3_folder)
    before = parts(model)
    lm_head_weight = model.lm_head.weight
    model.use_kernels(MarkingKernels(roles))
    after = parts(model)
    for place, part in after.items():
        role = ROLE_OF.get(place.split(".")[-1])
        if place == "lm_head":
            # Dropped once the set gave the output projection a twin of its own.
            assert (part is None) == ("linear" in roles)
        elif role in roles:
            assert isinstance(part, Marked) and part.role == role, place
        else:
            assert part is before[place], place
    if "linear" in roles:
        assert model.head.weight is lm_head_weight  # the head's twin shares its weight
    assert model.step_shape is not None


def test_the_torch_set_changes_nothing(qwen3_folder) -> None:
    model = tiny_model(qwen3_folder)
    before = parts(model)
    model.use_kernels(LayerKernels())
    assert parts(model) == before
    assert model.step_shape is None
    layer = model.decoder_layers()[0]
    assert isinstance(layer.input_layernorm, RMSNorm)
    assert isinstance(layer.self_attn.rotary, RotaryApply)
    assert isinstance(layer.mlp.act, SiluAndMul)


def test_cpu_kernels_pack_every_linear_and_share_one_step_shape(qwen3_folder) -> None:
    """float32 (the reference dtype): C GEMMs for every linear layer and the output
    projection, all told the step's shape by one object; the elementwise C ops are bf16's."""
    model = tiny_model(qwen3_folder)
    num_params = sum(p.numel() for p in model.parameters())
    kernels = CpuKernels(torch.float32, num_params, model.config.head_dim)
    model.use_kernels(kernels)
    kernels.settle_plan(model.modules())
    linears = [part for part in parts(model).values() if isinstance(part, CpuLinear)]
    assert len(linears) == 1 + 4 * model.config.num_layers
    assert all(linear.step is kernels.step_shape for linear in linears)
    assert model.step_shape is kernels.step_shape
    assert isinstance(model.norm, RMSNorm)  # no float32 C norm
