"""What pdserve's own Python costs an eager forward on the Triton path, the device's work left out.

On a GPU an eager forward (every prefill step, and a decode step without CUDA graphs) is paced by
the host issuing its launches, and for a small model that is most of its time: SmolLM2's shape
took 23 ms a decode step eager on an H100, 1.15 ms with graphs. Part of that is torch's and
Triton's launch machinery; part is pdserve's own Python around each launch (checks, block sizes,
views, the kernels' arguments). This benchmark times the second on the CPU: the model runs as on
CUDA for a 16-bit model (the Triton attention backend, the one-kernel norms, RoPE and
SiLU-and-multiply), with every Triton launch and every linear product (the head's too) made a
no-op that returns (an empty tensor of) the right shape. What is left is the forward's own host
time, with torch's cheapest calls (views, empty tensors) still in it.

The model has SmolLM2-135M's layers (30, 9 query heads of 64, 3 KV heads, hidden 576, MLP
1536) with weights drawn in place and a vocabulary of 1024.
It times, best of ``--rounds``, a decode forward of ``--batch`` rows over 64 tokens of context
each and a prefill forward of one ``--prompt``-token prompt, and prints ms a forward and us a
layer. ``--profile`` adds the functions that take the most host time over 20 decode forwards.

    python -m benchmarks.step.forward_host [--batch 8] [--prompt 256] [--rounds 50] [--profile]

Triton's interpreter is what lets the kernels' Python run without a GPU, so the benchmark runs
itself again with ``TRITON_INTERPRET=1`` where that is not set.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import tempfile

LAYERS, HEADS, KV_HEADS, HEAD_DIM, HIDDEN, MLP, VOCAB = 30, 9, 3, 64, 576, 1536, 1024
CONTEXT = 64  # tokens of context each decode row attends over
PAGE_SIZE = 16


def measure(args: argparse.Namespace) -> None:
    # Imported here: Triton reads TRITON_INTERPRET when a kernel is decorated.
    import torch
    from torch.nn import functional
    from transformers import LlamaConfig
    from triton.runtime.interpreter import InterpretedFunction

    from common.config import ModelConfig
    from common.engine.kv_pool import KVPool, kv_layout
    from common.model.loader import load_model
    from kernels.interface import AttentionMetadata
    from kernels.layer_kernels import CudaKernels
    from kernels.sizes import ceil_div
    from kernels.timing import best_seconds
    from kernels.triton.backend import TritonAttentionBackend

    InterpretedFunction.run = lambda self, *args, grid, warmup, **kwargs: None
    # The few ops left that touch data (the embedding's rows, the head's) would otherwise start
    # parallel regions whose threads wait on a shared machine's other work: on a GPU they are
    # launches, not host threads.
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as folder:
        LlamaConfig(
            hidden_size=HIDDEN,
            num_attention_heads=HEADS,
            num_key_value_heads=KV_HEADS,
            head_dim=HEAD_DIM,
            intermediate_size=MLP,
            num_hidden_layers=LAYERS,
            vocab_size=VOCAB,
            tie_word_embeddings=True,
            architectures=["LlamaForCausalLM"],
        ).save_pretrained(folder)
        config = ModelConfig.from_pretrained(folder)
    device, dtype = torch.device("cpu"), torch.float16
    model = load_model(config, dtype, device, load_format="dummy")
    model.use_kernels(CudaKernels())
    # Every linear layer and the head go through it.
    functional.linear = lambda x, weight, bias=None: x.new_empty(*x.shape[:-1], weight.shape[0])
    rows = max(args.batch * CONTEXT, args.prompt)
    num_pages = ceil_div(rows, PAGE_SIZE) + args.batch
    pool = KVPool(kv_layout(dtype, PAGE_SIZE, LAYERS, KV_HEADS, HEAD_DIM), num_pages, device)
    model.bind_kv(pool, TritonAttentionBackend())

    def decode_forward() -> None:
        batch, pages = args.batch, ceil_div(CONTEXT, PAGE_SIZE)
        meta = AttentionMetadata(
            query_start_loc=torch.arange(batch + 1, dtype=torch.int32),
            seq_lens=torch.full((batch,), CONTEXT, dtype=torch.int32),
            page_tables=torch.arange(batch * pages, dtype=torch.int32).view(batch, pages),
            slot_mapping=torch.arange(batch, dtype=torch.int64) * CONTEXT + CONTEXT - 1,
            max_query_len=1,
            max_seq_len=CONTEXT,
        )
        positions = torch.full((batch,), CONTEXT - 1)
        model(torch.ones(batch, dtype=torch.long), positions, meta, torch.arange(batch))

    def prefill_forward() -> None:
        tokens, pages = args.prompt, ceil_div(args.prompt, PAGE_SIZE)
        meta = AttentionMetadata(
            query_start_loc=torch.tensor([0, tokens], dtype=torch.int32),
            seq_lens=torch.tensor([tokens], dtype=torch.int32),
            page_tables=torch.arange(pages, dtype=torch.int32)[None],
            slot_mapping=torch.arange(tokens, dtype=torch.int64),
            max_query_len=tokens,
            max_seq_len=tokens,
        )
        last = torch.tensor([tokens - 1])
        model(torch.ones(tokens, dtype=torch.long), torch.arange(tokens), meta, last)

    print(
        f"SmolLM2-135M's layers ({LAYERS}), float16, the Triton path's kernels made no-ops; "
        f"best of {args.rounds}"
    )
    with torch.inference_mode():
        for label, forward in (
            (f"decode {args.batch} rows", decode_forward),
            (f"prefill {args.prompt} tokens", prefill_forward),
        ):
            seconds = best_seconds(forward, args.rounds)  # this machine is shared
            per_layer = seconds / LAYERS * 1e6
            print(f"{label}: {seconds * 1e3:.2f} ms a forward, {per_layer:.0f} us a layer")
        if args.profile:
            profile = cProfile.Profile()
            profile.enable()
            for _ in range(20):
                decode_forward()
            profile.disable()
            pstats.Stats(profile).sort_stats("tottime").print_stats(15)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8, help="decode rows (default 8)")
    parser.add_argument("--prompt", type=int, default=256, help="prefill tokens (default 256)")
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET") != "1":
        os.environ["TRITON_INTERPRET"] = "1"
        command = [sys.executable, "-m", "benchmarks.step.forward_host", *sys.argv[1:]]
        os.execv(sys.executable, command)
    measure(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
