"""Quantized checkpoints: which method a model's weights are stored in.

Detected from the checkpoint as vLLM does (its ``quantization_config``, or the GGUF file a
folder's weights are in: ``common/model/gguf_checkpoint.py``), and
``--quantization`` may name the method it must be: a mismatch is an error, never a guess. A
method pdserve does not read is refused at load, naming it.
"""

from __future__ import annotations

from common.config import ModelConfig
from common.model.gguf_checkpoint import gguf_weights_file
from common.model.quantization.compressed_tensors import METHOD as COMPRESSED_TENSORS
from common.model.quantization.gptq_awq import AWQ, GPTQ

GGUF = "gguf"
QUANTIZATION_METHODS = (COMPRESSED_TENSORS, GGUF, GPTQ, AWQ)


def quantization_method(config: ModelConfig, forced: str | None = None) -> str | None:
    """The method ``config``'s checkpoint is quantized with, None for 16- or 32-bit weights.

    ``forced``: ``--quantization``'s value, which the checkpoint must hold. Raises
    ``ValueError`` for a method pdserve does not read or one other than ``forced``."""
    found: str | None = None
    if gguf_weights_file(config.path) is not None:
        found = GGUF
    elif config.quantization_config is not None:
        raw = config.quantization_config
        method = raw.get("quant_method") if isinstance(raw, dict) else None
        if method not in QUANTIZATION_METHODS:
            raise ValueError(
                f"{config.path}: quantization_config.quant_method {method!r} is not read by "
                f"pdserve; it reads {', '.join(QUANTIZATION_METHODS)}"
            )
        found = method
    if forced is not None:
        if forced not in QUANTIZATION_METHODS:
            raise ValueError(
                f"--quantization must be one of {', '.join(QUANTIZATION_METHODS)}, got {forced!r}"
            )
        if found != forced:
            raise ValueError(
                f"--quantization {forced}: the checkpoint in {config.path} is "
                f"{found or 'not quantized'}"
            )
    return found
