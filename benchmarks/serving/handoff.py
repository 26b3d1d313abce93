"""The handoff of a long prompt, end to end: prefill's last chunk done -> decode holds every page.

Starts ``pdserve up`` (one prefill and one decode worker, the default model) once per KV-transfer
backend and way of shipping (each chunk's pages as it finishes, ``--ship-chunks``, or all pages
after the last chunk), with prefill chunks of ``--chunk`` tokens, and sends ``--requests``
prompts of ``--prompt-tokens`` random tokens one at a time, each asking for 2 tokens (the first
is sampled on the prefill worker, the second on the decode worker once the pages are there).
Around each request it reads the decode worker's metrics, so every figure belongs to one
request:

- handoff: ``pdserve_kv_handoff_seconds``, from the prefill worker finishing the last chunk to
  the decode worker holding every page (the Handoff message, the decode loop picking it up, the
  transfer with its request/acknowledge round trip);
- fetches: ``pdserve_kv_transfer_seconds`` on the receiver side, start_fetch to pages in place,
  summed over the request's fetches (one per shipped part, one for the rest), most of which
  overlap the prefill when chunks are shipped as they finish.

The first request of each backend also pays for the side channel's handshake and is reported
apart.

``--tp-pairs 1x1 1x2 2x1 2x2 1x4`` runs each (prefill TP, decode TP) pair in turn: handoff is
then the time from the prompt's last chunk to all its pages on the decode group (every decode
rank holding its heads), and fetches / fetch time count decode rank 0's reads only. The default
model has 3 KV heads, which 2 ranks cannot split: with TP pairs and no ``--model`` the benchmark
builds a random model with 4 KV heads (``--tp-model-layers`` layers of 8 query heads of 64,
SmolLM2's tokenizer). A row per backend, TP pair and way of shipping, in ms (2 CPU cores,
``--backends zmq --requests 2 --prompt-tokens 512 --chunk 256 --ship chunks``)::

     backend    TP          pages shipped   handoff  fetches  fetch time  first handoff
         zmq  1->1     as each chunk ends       7.9        2        21.1           10.9

Usage::

    python -m benchmarks.serving.handoff [--backends zmq nixl] [--requests 5] [--prompt-tokens 4096]
    python -m benchmarks.serving.handoff --tp-pairs 1x1 1x2 2x1 2x2 1x4 --ship chunks
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import httpx
import torch

from benchmarks.harness import pdserve_up, random_prompts, save_random_model
from common.metrics import parse_exposition
from common.model.default_model import resolve_model_path
from common.tokenizer import Tokenizer

HANDOFF = "pdserve_kv_handoff_seconds"
FETCH = 'pdserve_kv_transfer_seconds{{backend="{backend}",side="receiver"}}'


def scrape(metrics_url: str) -> dict[str, float]:
    return parse_exposition(httpx.get(metrics_url, timeout=10).text)


def histogram_delta(before: dict, after: dict, name: str) -> tuple[float, float]:
    """(observations, summed seconds) added to histogram ``name`` between two scrapes."""
    base, _, labels = name.partition("{")
    labels = "{" + labels if labels else ""
    count, total = f"{base}_count{labels}", f"{base}_sum{labels}"
    return (
        after.get(count, 0.0) - before.get(count, 0.0),
        after.get(total, 0.0) - before.get(total, 0.0),
    )


def build_tp_model(dest: Path, num_layers: int) -> Path:
    """A random Llama with 4 KV heads of 64 (8 query heads), bf16, SmolLM2's tokenizer: a model
    every pair of 1, 2 and 4 ranks can split."""
    from transformers import LlamaConfig

    from common.model.default_model import ensure_default_model

    config = LlamaConfig(
        vocab_size=49152, hidden_size=512, num_attention_heads=8, num_key_value_heads=4,
        head_dim=64, intermediate_size=1024, num_hidden_layers=num_layers,
        max_position_embeddings=16384, bos_token_id=1, eos_token_id=2, tie_word_embeddings=True,
    )  # fmt: skip
    return save_random_model(config, dest, torch.bfloat16, ensure_default_model(progress=False))


def run_backend(
    args, backend: str, ship_chunks: bool, folder: str, pair: tuple[int, int] = (1, 1)
) -> dict[str, list[float]]:
    up_flags = (
        "--kv-transfer", backend, "--remote-prefill-min-tokens", "1",
        # Every prompt to the prefill worker, even while a heartbeat still shows the last one
        # queued there.
        "--local-prefill-overflow-tokens", "1000000000",
        "--ship-chunks" if ship_chunks else "--no-ship-chunks",
        "--max-num-batched-tokens", str(args.chunk),
        "--prefill-tp", str(pair[0]), "--decode-tp", str(pair[1]),
        "--max-model-len", str(args.prompt_tokens + 64),
    )  # fmt: skip
    # Fresh prompts for every request: no prefix-cache hit anywhere.
    vocab_size = len(Tokenizer(folder))
    prompts = random_prompts(args.requests + 1, args.prompt_tokens, vocab_size, args.seed)
    figures: dict[str, list[float]] = {"handoff": [], "fetch": [], "fetches": []}
    # Up once the router lists the prefill worker too: a request sent before that is not
    # handed off.
    with pdserve_up(folder, *up_flags, port=args.port) as cluster:
        base_url = cluster.base_url
        workers = httpx.get(f"{base_url}/v1/workers", timeout=10).json()
        decode_metrics = workers["decode"][0]["metrics_url"]
        fetch_name = FETCH.format(backend=backend)
        for index, prompt in enumerate(prompts):
            before = scrape(decode_metrics)
            response = httpx.post(
                f"{base_url}/v1/completions",
                json={"model": folder.rsplit("/", 1)[-1], "prompt": prompt, "max_tokens": 2,
                      "temperature": 0, "ignore_eos": True},
                timeout=600,
            )  # fmt: skip
            response.raise_for_status()
            after = scrape(decode_metrics)
            handoffs, handoff_s = histogram_delta(before, after, HANDOFF)
            fetches, fetch_s = histogram_delta(before, after, fetch_name)
            if handoffs != 1 or fetches < 1:
                raise RuntimeError(
                    f"request {index} was not handed off once ({handoffs:g} handoffs, "
                    f"{fetches:g} fetches): is the router sending it to the prefill worker?"
                )
            if index == 0:
                figures["first_handoff"], figures["first_fetch"] = [handoff_s], [fetch_s]
            else:
                figures["handoff"].append(handoff_s)
                figures["fetch"].append(fetch_s)
                figures["fetches"].append(fetches)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backends", nargs="+", default=["zmq", "nixl"])
    parser.add_argument("--requests", type=int, default=5)
    parser.add_argument("--prompt-tokens", type=int, default=4096)
    parser.add_argument("--chunk", type=int, default=512, help="prefill chunk (token budget)")
    parser.add_argument("--model", default=None, help="model folder (default: SmolLM2)")
    parser.add_argument("--port", type=int, default=8300)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument(
        "--tp-pairs", nargs="+", default=["1x1"], help="PREFILLxDECODE tensor-parallel sizes"
    )
    parser.add_argument("--ship", choices=["both", "chunks", "last"], default="both")
    parser.add_argument("--tp-model-layers", type=int, default=8)
    args = parser.parse_args()
    pairs = [tuple(int(n) for n in pair.split("x")) for pair in args.tp_pairs]
    if args.model is None and any(size > 1 for pair in pairs for size in pair):
        scratch = Path(tempfile.mkdtemp(prefix="handoff-tp-model-"))
        folder = str(build_tp_model(scratch / "tp-model", args.tp_model_layers))
    else:
        folder = str(resolve_model_path(args.model))
    ships = {"both": (True, False), "chunks": (True,), "last": (False,)}[args.ship]
    results = {
        (backend, ship, pair): run_backend(args, backend, ship, folder, pair)
        for backend in args.backends
        for pair in pairs
        for ship in ships
    }

    print(
        f"\n{args.prompt_tokens}-token prompt in {args.chunk}-token chunks, "
        f"{folder.rsplit('/', 1)[-1]}; median of {args.requests} requests (ms)"
    )
    print(
        f"{'backend':>8} {'TP':>5} {'pages shipped':>22} {'handoff':>9} {'fetches':>8} "
        f"{'fetch time':>11} {'first handoff':>14}"
    )
    for (backend, ship, pair), figures in results.items():
        print(
            f"{backend:>8} {f'{pair[0]}->{pair[1]}':>5} "
            f"{'as each chunk ends' if ship else 'after the last chunk':>22} "
            f"{1e3 * statistics.median(figures['handoff']):9.1f} "
            f"{statistics.median(figures['fetches']):8.0f} "
            f"{1e3 * statistics.median(figures['fetch']):11.1f} "
            f"{1e3 * figures['first_handoff'][0]:14.1f}"
        )
    print(
        "handoff: the prefill worker's last chunk done -> every page held by the decode worker; "
        "fetch time: start_fetch -> pages in place, summed over the fetches; first: includes "
        "the side channel's handshake"
    )


if __name__ == "__main__":
    main()
