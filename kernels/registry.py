"""Picks the attention backend: Triton on CUDA, the torch reference elsewhere.

``PDSERVE_ATTENTION_BACKEND=triton|torch`` overrides the choice; on a CPU, ``triton`` is only
useful under ``TRITON_INTERPRET=1`` (the kernel tests run that way).
"""

from __future__ import annotations

import importlib
import os

import torch

from kernels.interface import AttentionBackend

ENV_VAR = "PDSERVE_ATTENTION_BACKEND"

# name -> "module:Class", imported only when chosen so a CPU install never needs Triton to load.
_BACKENDS = {
    "torch": "kernels.reference:TorchAttentionBackend",
    "triton": "kernels.triton_backend:TritonAttentionBackend",
}


def available_backends() -> list[str]:
    return sorted(_BACKENDS)


def get_attention_backend(device: torch.device, name: str | None = None) -> AttentionBackend:
    name = name or os.environ.get(ENV_VAR) or ("triton" if device.type == "cuda" else "torch")
    if name not in _BACKENDS:
        raise ValueError(
            f"unknown attention backend {name!r}; choose one of {', '.join(available_backends())}"
        )
    module_name, class_name = _BACKENDS[name].split(":")
    return getattr(importlib.import_module(module_name), class_name)()
