"""Quantized weights against the same model's 16-bit weights, measured as
``benchmarks/quality/kv_quality.py`` measures KV formats: the same held-out text (Python's
reference manual), teacher-forced through each model, each position's next-token distribution
compared with the 16-bit model's. One line per format::

    weights FORMAT: kld_mean X kld_p99 Y top1 Z% ppl_ratio R

Beside each, the same checkpoint dequantized to float32 by the format's own library
(compressed-tensors' ``dequantize``; the gguf package's) and run dense: what the format itself
loses. pdserve's quantized kernels add no error of their own where the two agree (for
weight-only formats: perplexity within 0.5%, top-1 within a point). Formats that also round
each layer's inputs (FP8, W8A8) do so in pdserve and not in the dense copy, so their two rows
differ by that rounding too.

The checkpoints are made here from the default model (SmolLM2-135M-Instruct, bf16 weights
dequantized once from its Q4_1 GGUF): compressed-tensors ones by ``pdserve quantize``
(llm-compressor's presets, round to nearest; groups of 64, which divide its 576 columns), and
its own Q4_1 GGUF file, served as it is (its 16-bit reference is the same file dequantized, so
that row measures pdserve's kernels only). Everything runs in float32 (``--dtype``), so the
rows differ by the weights alone. Where int8 and 4-bit codes are summed in integers
(``kernels/cpu/quantized_quads.c``), a third row runs the checkpoint through the float32 tiles
instead: what the integer sums' rounding of the inputs costs, if anything (with ``--dtype
bfloat16``, where they round inputs at 2^-14 of each row's largest value).

    python -m benchmarks.quality.weight_quality [--formats W4A16,FP8_DYNAMIC,...]
        [--tokens 2048] [--segment 256] [--dtype float32]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path
from unittest import mock

import torch
from safetensors.torch import load_file, save_file

from benchmarks.quality.kv_quality import (
    FORMATS as KV_FORMATS,
)
from benchmarks.quality.kv_quality import (
    REFERENCE as BF16_KV,
)
from benchmarks.quality.kv_quality import (
    Quality,
    Segments,
    build_engine,
    cut_segments,
    held_out_text,
    measure,
    progress_to_stderr,
)
from common.model.quantization.writer import SCHEMES, write_compressed_tensors
from common.tokenizer import Tokenizer
from kernels.cpu.quantized_linear import ENV_INTEGER_SUMS, CpuQuantizedLinear

SIXTEEN_BIT = "16-bit"
DEQUANTIZED = "dequantized"
FLOAT_TILES = "float32 tiles"
GGUF_Q4_1 = "GGUF_Q4_1"
DEFAULT_FORMATS = ("FP8_DYNAMIC", "FP8_BLOCK", "W8A8", "W8A16", "W4A16", "W4A16_ASYM", GGUF_Q4_1)
# Groups of the grouped schemes: 64 divides SmolLM2's 576 and 1536 columns; 128 does not.
GROUP_SIZE = 64
# What "adds no error" allows, between pdserve's run of a checkpoint and its dense copy.
PPL_MATCH = 0.005
TOP1_MATCH = 0.01


def dequantized_compressed_tensors(folder: Path, target: Path) -> Path:
    """``folder``'s compressed-tensors checkpoint with every quantized layer dequantized to
    float32 by compressed-tensors' own functions, as a dense folder."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    raw = json.loads((folder / "config.json").read_text())
    group = raw.pop("quantization_config")["config_groups"]["group_0"]
    args = QuantizationArgs(**group["weights"])
    tensors = load_file(str(folder / "model.safetensors"))
    dense: dict[str, torch.Tensor] = {}
    layers = {
        name.rpartition(".")[0]
        for name in tensors
        if name.endswith((".weight_packed", ".weight_scale"))
    }
    for name, tensor in tensors.items():
        if name.rpartition(".")[0] not in layers:
            dense[name] = tensor.float()
    for layer in layers:
        scale = tensors[f"{layer}.weight_scale"].float()
        zero = tensors.get(f"{layer}.weight_zero_point")
        if f"{layer}.weight_packed" in tensors:
            shape = torch.Size(tensors[f"{layer}.weight_shape"].tolist())
            codes = unpack_from_int32(tensors[f"{layer}.weight_packed"], args.num_bits, shape)
            if zero is not None:
                zero = unpack_from_int32(zero, args.num_bits, scale.shape, packed_dim=0)
        else:
            codes = tensors[f"{layer}.weight"]
        dense[f"{layer}.weight"] = dequantize(codes, scale, zero, args, torch.float32)
    target.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in dense.items()}, str(target / "model.safetensors"))
    raw["torch_dtype"] = raw["dtype"] = "float32"
    (target / "config.json").write_text(json.dumps(raw))
    for extra in folder.iterdir():
        if extra.name.startswith(("tokenizer", "generation_config", "special_tokens")):
            (target / extra.name).symlink_to(extra)
    return target


def checkpoints(name: str, base: Path, scratch: Path) -> tuple[Path, Path, Path]:
    """(16-bit model, the format's checkpoint, its dense dequantized copy) for format ``name``."""
    from common.model.default_model import default_gguf_model, dequantize_gguf, find_default_gguf

    if name == GGUF_Q4_1:
        folder, _ = default_gguf_model()
        dense = dequantize_gguf(find_default_gguf(), scratch / "q4_1-dense", "float32")
        return dense, folder, dense
    quantized = write_compressed_tensors(base, scratch / name, name, GROUP_SIZE)
    return base, quantized, dequantized_compressed_tensors(quantized, scratch / f"{name}-dense")


def float_tiles_engine(model: str, segments: Segments, dtype: str):
    """An engine over ``model`` whose int8 and 4-bit codes take the float32 tiles, not the
    integer sums (``kernels/cpu/quantized_linear.py``)."""
    with mock.patch.dict(os.environ, {ENV_INTEGER_SUMS: "0"}):
        return build_engine(model, KV_FORMATS[BF16_KV], segments, dtype=dtype)


def quality_of(
    name: str, base: Path, segments: Segments, scratch: Path, dtype: str
) -> dict[str, Quality]:
    """The format in pdserve, its dense copy and (``FLOAT_TILES``, where the integer sums run
    here) the format through the float32 tiles, each against the 16-bit model."""
    sixteen, quantized, dense = checkpoints(name, base, scratch)
    kv = KV_FORMATS[BF16_KV]
    engines = {
        SIXTEEN_BIT: build_engine(str(sixteen), kv, segments, dtype=dtype),
        name: build_engine(str(quantized), kv, segments, dtype=dtype),
        DEQUANTIZED: build_engine(str(dense), kv, segments, dtype=dtype),
    }
    if integer_sums_run(engines[name]):
        engines[FLOAT_TILES] = float_tiles_engine(str(quantized), segments, dtype)
    progress = progress_to_stderr(len(segments.decode_positions))
    qualities = {q.name: q for q in measure(engines, segments, progress, SIXTEEN_BIT)}
    for engine in engines.values():
        engine.close()
    return qualities


def integer_sums_run(engine) -> bool:
    """Whether any of ``engine``'s linear layers sums its codes in integers."""
    return any(
        isinstance(module, CpuQuantizedLinear) and module.packed.integer_sums
        for module in engine.model.modules()
    )


def line(quality: Quality, label: str) -> str:
    return (
        f"{label}: kld_mean {quality.kld_mean:.4g} kld_p99 {quality.kld_p99:.4g} "
        f"top1 {quality.top1:.2%} ppl_ratio {quality.ppl_ratio:.5f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--formats", default=",".join(DEFAULT_FORMATS))
    parser.add_argument("--tokens", type=int, default=2048, help="tokens of text to read")
    parser.add_argument("--segment", type=int, default=256, help="tokens per segment")
    parser.add_argument("--context", type=int, default=32, help="tokens prefilled per segment")
    parser.add_argument("--chunk", type=int, default=32, help="prefill chunk per segment")
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="what every model runs in (bfloat16: the 16-bit model and the dense copy too)",
    )
    args = parser.parse_args()
    from common.model.default_model import resolve_model_path

    formats = [name for name in args.formats.split(",") if name]
    unknown = [name for name in formats if name not in SCHEMES and name != GGUF_Q4_1]
    if unknown:
        raise SystemExit(f"unknown formats {unknown}; one of {[*SCHEMES, GGUF_Q4_1]}")
    base = resolve_model_path(None)
    text_ids = Tokenizer(base).encode(held_out_text(), add_special_tokens=False)
    segments = cut_segments(text_ids[: args.tokens], args.segment, args.context, args.chunk)
    count = len(segments.token_ids)
    print(
        f"{base.name}: pydoc_data.topics, {count} segments x {segments.length} tokens, "
        f"{segments.context} prefilled, {segments.num_scored} positions scored; {args.dtype}"
    )
    for name in formats:
        with tempfile.TemporaryDirectory() as scratch:
            qualities = quality_of(name, base, segments, Path(scratch), args.dtype)
        ours, dense = qualities[name], qualities[DEQUANTIZED]
        same = (
            abs(ours.perplexity / dense.perplexity - 1) <= PPL_MATCH
            and abs(ours.top1 - dense.top1) <= TOP1_MATCH
        )
        print(line(ours, f"weights {name}"), flush=True)
        print(
            line(dense, f"  dequantized {name}")
            + f"  (pdserve / dequantized perplexity {ours.perplexity / dense.perplexity:.5f}; "
            + ("adds no error)" if same else "differs)"),
            flush=True,
        )
        if FLOAT_TILES in qualities:
            print(line(qualities[FLOAT_TILES], f"  {name} through the float32 tiles"), flush=True)


if __name__ == "__main__":
    main()
