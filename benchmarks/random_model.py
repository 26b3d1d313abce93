"""A model folder with another model's shape and tokenizer, and random weights.

A serving benchmark on a machine that cannot be given the weights still does the same work per
token: the same layers, head counts and vocabulary, in the same dtype. With ``ignore_eos`` (as
benchmarks/serving.py sends) the output lengths do not depend on what the weights say. The GPU
check (scripts/gpu_check.sh) serves SmolLM2-135M-Instruct this way: its config and tokenizer are
3.5 MB, its weights 270 MB, more than a GPU run may carry.

    python -m benchmarks.random_model SOURCE DEST   # SOURCE: config.json and tokenizer files
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def build_random_model(source: Path, dest: Path, dtype: torch.dtype, seed: int = 0) -> Path:
    """Write ``dest``: ``source``'s config and tokenizer, weights drawn as the model's own
    initialisation draws them."""
    config = AutoConfig.from_pretrained(source)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(dest)
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, dest / name)
    return dest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path, help="folder with config.json and the tokenizer")
    parser.add_argument("dest", type=Path)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    folder = build_random_model(args.source, args.dest, getattr(torch, args.dtype), args.seed)
    print(folder)


if __name__ == "__main__":
    main()
