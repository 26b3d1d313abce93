"""Picks the attention backend: Triton on CUDA, the C kernels on a CPU, the portable torch
backend where the C kernels cannot be built (no compiler).

``PDSERVE_ATTENTION_BACKEND=triton|cpu|torch`` overrides the choice; on a CPU, ``triton`` is
only useful under ``TRITON_INTERPRET=1`` (the kernel tests run that way).
"""

from __future__ import annotations

import importlib
import logging
import os

import torch

from kernels.cpu.library import CpuKernelsUnavailable
from kernels.interface import AttentionBackend

logger = logging.getLogger(__name__)

ENV_VAR = "PDSERVE_ATTENTION_BACKEND"

# name -> "module:Class", imported only when chosen so a CPU install never needs Triton to load.
_BACKENDS = {
    "cpu": "kernels.cpu.backend:CpuAttentionBackend",
    "torch": "kernels.torch_backend:TorchAttentionBackend",
    "triton": "kernels.triton.backend:TritonAttentionBackend",
}
# Backends with a batch-invariant mode (their constructor takes ``deterministic``).
_DETERMINISTIC = ("cpu", "triton")


def available_backends() -> list[str]:
    return sorted(_BACKENDS)


def default_backend(device: torch.device) -> str:
    return "triton" if device.type == "cuda" else "cpu"


def get_attention_backend(
    device: torch.device, name: str | None = None, deterministic: bool = False
) -> AttentionBackend:
    """The backend for ``device``. ``deterministic``: one whose sums are fixed by absolute
    positions (batch-invariant); only the C and Triton backends have that mode."""
    chosen = name or os.environ.get(ENV_VAR)
    name = chosen or default_backend(device)
    if name not in _BACKENDS:
        raise ValueError(
            f"unknown attention backend {name!r}; choose one of {', '.join(available_backends())}"
        )
    if deterministic and name not in _DETERMINISTIC:
        raise ValueError(
            f"deterministic inference needs the {' or '.join(_DETERMINISTIC)} attention backend, "
            f"not {name!r}"
        )
    try:
        return _create(name, deterministic)
    except CpuKernelsUnavailable as exc:
        if chosen or deterministic:
            raise ValueError(f"attention backend {name!r} is unavailable: {exc}") from exc
        logger.warning("CPU kernels unavailable (%s); using the portable torch backend", exc)
        return _create("torch", False)


def _create(name: str, deterministic: bool) -> AttentionBackend:
    module_name, class_name = _BACKENDS[name].split(":")
    backend_class = getattr(importlib.import_module(module_name), class_name)
    return backend_class(deterministic=True) if deterministic else backend_class()
