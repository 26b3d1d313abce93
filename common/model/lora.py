"""LoRA beside the layers it wraps: an adapter's tensors read from its PEFT folder and checked
against the base model, and the slots on the device that a forward's adapters compute from.

Every decoder layer's four projections get a ``LoraProjection`` (``attach_lora``): q, k and v
share ``qkv_proj``'s, gate and up ``gate_up_proj``'s, o and down have their own. Each holds
``max_loras`` slots of stacked A and B tensors (``kernels/lora.py`` has the layout); an
adapter is written into a slot (``LoraSlots.load``) and a forward's rows name the slot they
compute under (``LoraSegments``, passed to the model's forward).

Under tensor parallelism a slot holds this rank's slice, as the base layer is sliced
(``common/model/parallel.py``): column-parallel layers (q, k, v, gate, up) keep all of A and
their rows of B, so the delta lands on this rank's output columns; row-parallel layers (o,
down) keep their columns of A and all of B, so each rank's delta is a partial sum that the
layer's one all-reduce completes with the base layer's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import SafetensorError, safe_open

from common.config import ModelConfig
from common.lora_adapters import COVERED_TARGETS, WEIGHTS_FILE, read_adapter_config
from common.model.loader import module_slice
from common.model.lora_layers import LoraProjection
from common.model.mlp import MLP
from common.model.parallel import TensorParallel

if TYPE_CHECKING:
    from common.model.llama import LlamaForCausalLM

_KEY = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$"
)
_OWNER = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}
# pdserve's fused projection -> the PEFT targets it computes, in the order of its output.
PROJECTIONS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}


@dataclass(frozen=True, slots=True)
class LoraAdapter:
    """One adapter's tensors in host memory, whole (every rank slices its own part)."""

    name: str
    path: str
    rank: int
    scale: float
    # (layer, PEFT target) -> (A [rank, in], B [out, rank]), float32
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def targets(self) -> list[str]:
        return sorted({target for _, target in self.weights})

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def target_shape(config: ModelConfig, target: str) -> tuple[int, int]:
    """``(out, in)`` of the base model's whole linear layer ``target``."""
    q_size = config.num_heads * config.head_dim
    kv_size = config.num_kv_heads * config.head_dim
    hidden, width = config.hidden_size, config.intermediate_size
    return {
        "q_proj": (q_size, hidden),
        "k_proj": (kv_size, hidden),
        "v_proj": (kv_size, hidden),
        "o_proj": (hidden, q_size),
        "gate_proj": (width, hidden),
        "up_proj": (width, hidden),
        "down_proj": (hidden, width),
    }[target]


def load_adapter(name: str, path: str | Path, config: ModelConfig, max_rank: int) -> LoraAdapter:
    """Read the PEFT adapter in ``path`` for the base model ``config``. ``ValueError`` naming
    the problem: a config pdserve does not compute (``common/lora_adapters.py``), a rank above
    ``max_rank``, a tensor of another base model's shape or of a module not served, a missing
    or unreadable tensor."""
    check_lora_servable(config)
    adapter_config = read_adapter_config(path, max_rank)
    where = f"LoRA adapter {path}"
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    try:
        with safe_open(Path(path) / WEIGHTS_FILE, framework="pt") as tensors:
            for key in tensors.keys():  # noqa: SIM118 (safe_open is no mapping)
                match = _KEY.match(key)
                if match is None:
                    raise ValueError(
                        f"{where}: tensor {key!r} is not served (pdserve serves LoRA A and B of "
                        f"{', '.join(COVERED_TARGETS)})"
                    )
                layer, owner, target, half = (
                    int(match.group(1)),
                    match.group(2),
                    match.group(3),
                    match.group(4),
                )
                if _OWNER.get(target) != owner:
                    raise ValueError(
                        f"{where}: {key!r} targets {owner}.{target}, which is not served "
                        f"(pdserve serves {', '.join(COVERED_TARGETS)})"
                    )
                if layer >= config.num_layers:
                    raise ValueError(
                        f"{where}: {key!r} is for layer {layer}, but the base model "
                        f"{config.path} has {config.num_layers} layers"
                    )
                halves.setdefault((layer, target), {})[half] = tensors.get_tensor(key).float()
    except (SafetensorError, OSError) as exc:
        raise ValueError(f"{where}: {WEIGHTS_FILE} is not readable safetensors: {exc}") from None
    if not halves:
        raise ValueError(f"{where}: {WEIGHTS_FILE} holds no LoRA tensors")
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for (layer, target), pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            missing = "B" if "A" in pair else "A"
            raise ValueError(f"{where}: layer {layer} {target} has no lora_{missing} tensor")
        a, b = pair["A"], pair["B"]
        out_features, in_features = target_shape(config, target)
        rank = adapter_config.rank
        if a.shape != (rank, in_features) or b.shape != (out_features, rank):
            raise ValueError(
                f"{where}: layer {layer} {target} has A {tuple(a.shape)} and B {tuple(b.shape)}, "
                f"but rank {rank} over the base model {config.path} needs A "
                f"{(rank, in_features)} and B {(out_features, rank)}: an adapter of another "
                "base model?"
            )
        weights[(layer, target)] = (a, b)
    return LoraAdapter(
        name=name,
        path=str(path),
        rank=adapter_config.rank,
        scale=adapter_config.scale,
        weights=weights,
    )


def check_lora_servable(config: ModelConfig) -> None:
    """Raise ``ValueError`` if adapters cannot be served over ``config``'s model."""
    if config.moe is not None:
        raise ValueError(
            f"LoRA adapters are served over dense models only; {config.path} is a mixture "
            "of experts"
        )


def _rank_part(
    target: str, a: torch.Tensor, b: torch.Tensor, config: ModelConfig, tp: TensorParallel
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's (A, B) of ``target``, sliced as the base layer is (``module_slice``): B's
    rows where the layer's output rows are split, A's columns where its input columns are."""
    part = module_slice(f"{_OWNER[target]}.{target}", config, tp)
    if part is None:
        return a, b
    dim, start, stop = part
    return (a, b[start:stop]) if dim == 0 else (a[:, start:stop], b)


class LoraSlots:
    """The ``max_loras`` adapter slots of every ``LoraProjection`` of one model (one rank's)."""

    def __init__(
        self,
        layers: list[dict[str, LoraProjection]],
        config: ModelConfig,
        tp: TensorParallel,
        max_loras: int,
        max_rank: int,
    ) -> None:
        self.layers = layers  # per decoder layer: fused projection name -> its slots
        self.config = config
        self.tp = tp
        self.max_loras = max_loras
        self.max_rank = max_rank

    def load(self, slot: int, adapter: LoraAdapter) -> None:
        """Write ``adapter`` into ``slot`` of every projection (its untargeted ones zero)."""
        if not 0 <= slot < self.max_loras:
            raise ValueError(f"LoRA slot {slot} is not in [0, {self.max_loras})")
        if adapter.rank > self.max_rank:
            raise ValueError(
                f"LoRA adapter {adapter.name}: rank {adapter.rank} is above --max-lora-rank "
                f"{self.max_rank}"
            )
        for index, projections in enumerate(self.layers):
            for projection in projections.values():
                parts: list[tuple[torch.Tensor, torch.Tensor] | None] = []
                for target in projection.targets:
                    pair = adapter.weights.get((index, target))
                    if pair is None:
                        parts.append(None)
                        continue
                    a, b = _rank_part(target, *pair, self.config, self.tp)
                    parts.append((a.to(projection.a.dtype), b.to(projection.b.dtype)))
                projection.write(slot, parts, adapter.scale)

    def clear(self, slot: int) -> None:
        for projections in self.layers:
            for projection in projections.values():
                projection.clear(slot)


def attach_lora(
    model: LlamaForCausalLM, max_loras: int, max_rank: int, dtype: torch.dtype
) -> LoraSlots:
    """Give every decoder layer of ``model`` its ``LoraProjection``s, empty, in ``dtype`` (the
    activations'; on a CPU float32 unless bf16), and return their slots."""
    if max_loras < 1 or max_rank < 1:
        raise ValueError(f"--max-loras and --max-lora-rank must be >= 1: {max_loras}, {max_rank}")
    config, tp, device = model.config, model.tp, model.device
    check_lora_servable(config)
    # On a CPU the C kernel (kernels/cpu/lora_delta.py) reads bf16 slots; other dtypes take
    # torch's matmuls, whose 16-bit forms of these thin shapes are slow there (kernels/lora.py).
    if device.type == "cpu" and dtype != torch.bfloat16:
        dtype = torch.float32
    layers: list[dict[str, LoraProjection]] = []
    for layer in model.decoder_layers():
        attention, mlp = layer.self_attn, layer.mlp
        assert isinstance(mlp, MLP), "check_lora_servable refuses mixtures"
        q_size, kv_size = attention.q_size, attention.kv_size
        width = mlp.intermediate_size
        hidden = config.hidden_size

        def projection(targets: tuple[str, ...], in_features: int, out_sizes: list[int]):
            return LoraProjection(
                targets, in_features, out_sizes, max_loras, max_rank, dtype, device
            )

        projections = {
            "qkv_proj": projection(PROJECTIONS["qkv_proj"], hidden, [q_size, kv_size, kv_size]),
            "o_proj": projection(PROJECTIONS["o_proj"], q_size, [hidden]),
            "gate_up_proj": projection(PROJECTIONS["gate_up_proj"], hidden, [width, width]),
            "down_proj": projection(PROJECTIONS["down_proj"], width, [hidden]),
        }
        attention.qkv_lora, attention.o_lora = projections["qkv_proj"], projections["o_proj"]
        mlp.gate_up_lora, mlp.down_lora = projections["gate_up_proj"], projections["down_proj"]
        layers.append(projections)
    return LoraSlots(layers, config, tp, max_loras, max_rank)
