"""LoRA adapters as files and names, without torch: what the router and the workers share.

An adapter is a PEFT folder: ``adapter_config.json`` and ``adapter_model.safetensors``. This
module parses ``--lora-modules`` entries, reads and checks the config (what pdserve serves of
PEFT's LoRA, refusing the rest by name), and gives each adapter's prefix-cache namespace: its
name and a digest of its files, so pages computed under one adapter never serve another, nor
one loaded again under the same name with other weights (``common/hashing.py``). The tensors
themselves are read by ``common/model/lora.py``.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# The PEFT target modules pdserve computes a delta for: every linear layer of a decoder layer.
# The embedding and the output head (and anything else) are refused by name at load.
COVERED_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# PEFT config fields that change the arithmetic, with the value under which pdserve computes
# it exactly; any other value refuses the adapter, naming the field.
_PLAIN_FIELDS: dict[str, object] = {
    "use_dora": False,
    "fan_in_fan_out": False,
    "bias": "none",
    "modules_to_save": None,
    "rank_pattern": {},
    "alpha_pattern": {},
    "layer_replication": None,
    "lora_bias": False,
    "use_qalora": False,
    "target_parameters": None,
    "trainable_token_indices": None,
    "alora_invocation_tokens": None,
}
MAX_NAME_LENGTH = 256


@dataclass(frozen=True, slots=True)
class LoraModule:
    """One adapter to serve: the name requests give as their ``model``, its folder, and the
    base model it was trained on (informational, as in vLLM's JSON form)."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(text: str) -> LoraModule:
    """One ``--lora-modules`` entry: ``name=path``, or vLLM's JSON form
    ``{"name": ..., "path": ..., "base_model_name": ...}``."""
    text = text.strip()
    if text.startswith("{"):
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--lora-modules {text!r} is not valid JSON: {exc}") from None
        if not isinstance(raw, dict) or not {"name", "path"} <= raw.keys():
            raise ValueError(f"--lora-modules {text!r}: the JSON form needs name and path")
        unknown = set(raw) - {"name", "path", "base_model_name"}
        if unknown:
            raise ValueError(f"--lora-modules {text!r}: unknown fields {sorted(unknown)}")
        base = raw.get("base_model_name")
        if not all(isinstance(raw[k], str) for k in ("name", "path")) or not isinstance(
            base, str | None
        ):
            raise ValueError(f"--lora-modules {text!r}: name, path and base_model_name are strings")
        module = LoraModule(raw["name"], raw["path"], base)
    else:
        name, sep, path = text.partition("=")
        if not sep:
            raise ValueError(f"--lora-modules {text!r} is neither name=path nor JSON")
        module = LoraModule(name.strip(), path.strip())
    check_adapter_name(module.name)
    if not module.path:
        raise ValueError(f"--lora-modules {text!r}: the path is empty")
    return module


def check_adapter_name(name: str) -> None:
    if not name or len(name) > MAX_NAME_LENGTH or any(c.isspace() for c in name):
        raise ValueError(
            f"LoRA adapter name {name!r}: 1 to {MAX_NAME_LENGTH} characters, no whitespace"
        )


@dataclass(frozen=True, slots=True)
class AdapterConfig:
    """What pdserve reads of an ``adapter_config.json``."""

    rank: int
    alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...] | None  # None: a pattern, checked against the tensors
    base_model_name: str | None

    @property
    def scale(self) -> float:
        """PEFT's scaling: ``alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA."""
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


def read_adapter_config(folder: str | Path, max_rank: int) -> AdapterConfig:
    """Read and check ``folder``'s ``adapter_config.json``; ``ValueError`` naming the problem."""
    folder = Path(folder)
    where = f"LoRA adapter {folder}"
    if not folder.is_dir():
        raise ValueError(f"{where}: no such folder")
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not (folder / name).is_file():
            raise ValueError(f"{where}: {name} is missing (a PEFT adapter folder has both)")
    try:
        raw = json.loads((folder / CONFIG_FILE).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{where}: {CONFIG_FILE} is not readable JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: {CONFIG_FILE} is not a JSON object")
    peft_type = raw.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise ValueError(f"{where}: peft_type {peft_type!r} is not served, only LORA")
    for field, plain in _PLAIN_FIELDS.items():
        value = raw.get(field, plain)
        if value != plain and not (plain is None and value in ({}, [], "")):
            raise ValueError(f"{where}: {field}={value!r} is not served (only {plain!r})")
    rank, alpha = raw.get("r"), raw.get("lora_alpha")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"{where}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise ValueError(f"{where}: rank {rank} is above --max-lora-rank {max_rank}")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise ValueError(f"{where}: lora_alpha must be a number, got {alpha!r}")
    use_rslora = raw.get("use_rslora", False)
    if not isinstance(use_rslora, bool):
        raise ValueError(f"{where}: use_rslora must be true or false, got {use_rslora!r}")
    targets = raw.get("target_modules")
    target_modules: tuple[str, ...] | None = None
    if isinstance(targets, list):
        names = [t.rsplit(".", 1)[-1] if isinstance(t, str) else t for t in targets]
        uncovered = [t for t in names if t not in COVERED_TARGETS]
        if uncovered:
            raise ValueError(
                f"{where}: target modules {uncovered} are not served "
                f"(pdserve serves {', '.join(COVERED_TARGETS)})"
            )
        target_modules = tuple(names)
    elif not isinstance(targets, str):
        raise ValueError(f"{where}: target_modules must be a list or a pattern, got {targets!r}")
    base = raw.get("base_model_name_or_path")
    return AdapterConfig(
        rank=rank,
        alpha=float(alpha),
        use_rslora=use_rslora,
        target_modules=target_modules,
        base_model_name=base if isinstance(base, str) else None,
    )


def adapter_namespace(name: str, folder: str | Path) -> str:
    """The prefix-cache namespace of adapter ``name`` loaded from ``folder``: its name and a
    digest of its two files. The router and every worker compute the same one."""
    digest = hashlib.blake2b(digest_size=8, person=b"pdserve-lora")
    for file in (CONFIG_FILE, WEIGHTS_FILE):
        try:
            digest.update((Path(folder) / file).read_bytes())
        except OSError as exc:
            raise ValueError(f"LoRA adapter {folder}: {file} is not readable: {exc}") from None
    return f"lora:{name}:{digest.hexdigest()}"
