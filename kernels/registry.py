"""Picks the attention backend: Triton on CUDA, the C kernels on a CPU, the torch reference
where the C kernels cannot be built (no compiler).

``PDSERVE_ATTENTION_BACKEND=triton|cpu|torch`` overrides the choice; on a CPU, ``triton`` is
only useful under ``TRITON_INTERPRET=1`` (the kernel tests run that way).
"""

from __future__ import annotations

import importlib
import logging
import os

import torch

from kernels.cpu_library import CpuKernelsUnavailable
from kernels.interface import AttentionBackend

logger = logging.getLogger(__name__)

ENV_VAR = "PDSERVE_ATTENTION_BACKEND"

# name -> "module:Class", imported only when chosen so a CPU install never needs Triton to load.
_BACKENDS = {
    "cpu": "kernels.cpu_backend:CpuAttentionBackend",
    "torch": "kernels.reference:TorchAttentionBackend",
    "triton": "kernels.triton_backend:TritonAttentionBackend",
}


def available_backends() -> list[str]:
    return sorted(_BACKENDS)


def default_backend(device: torch.device) -> str:
    return "triton" if device.type == "cuda" else "cpu"


def get_attention_backend(device: torch.device, name: str | None = None) -> AttentionBackend:
    chosen = name or os.environ.get(ENV_VAR)
    name = chosen or default_backend(device)
    if name not in _BACKENDS:
        raise ValueError(
            f"unknown attention backend {name!r}; choose one of {', '.join(available_backends())}"
        )
    try:
        return _create(name)
    except CpuKernelsUnavailable as exc:
        if chosen:
            raise ValueError(f"attention backend {name!r} is unavailable: {exc}") from exc
        logger.warning("CPU kernels unavailable (%s); using the torch reference backend", exc)
        return _create("torch")


def _create(name: str) -> AttentionBackend:
    module_name, class_name = _BACKENDS[name].split(":")
    return getattr(importlib.import_module(module_name), class_name)()
