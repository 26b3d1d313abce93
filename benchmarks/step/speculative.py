"""Speculative decoding against plain decoding, in one run, on one pinned core (a decode worker's
share of this machine under `pdserve up`).

The workloads are repetitive on purpose, each prompt asking the model to rewrite what it is given:
``code`` asks it to copy ~240 tokens of pdserve's own source, ``text`` to fix the grammar of a
~240-token paragraph of pdserve's documentation and return it whole. SmolLM2-135M drifts from
code after a few lines (its output repeats its input less), while it returns prose nearly
verbatim. Decode tokens/s (the tokens after each request's first, over the time from its first
token to its last) at batch 1 and 8: without speculation, with n-gram lookup, and with a draft
model. Greedy, so all three must give the very same tokens (checked). The draft is SmolLM2's
own first layers with its head (no other checkpoint with its tokenizer can be had here),
written to ``--draft-dir``.

It also measures where a draft's prompt KV should come from: the draft prefilling a prompt on
the decode worker, against shipping the same pages from a prefill worker (the bytes of the
draft's KV for that prompt over a loopback ZeroMQ socket, the transfer alone). A row per
workload, batch and engine, e.g. on a shared 2-core box (``--max-tokens 16 --batches 1
--rounds 1 --workloads text``)::

                                 decode tok/s  vs plain  accepted  tokens/step
    text batch 1  ngram k=4               74.9     1.96x      62%         3.33

    python -m benchmarks.step.speculative [--model PATH] [--core 0] [--draft-layers 4] [-k 4]
        [--workloads code,text]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import zmq
from safetensors.torch import load_file, save_file

from benchmarks.harness import add_core_argument, pin_to_cores
from common.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from common.engine.llm_engine import LLMEngine
from common.engine.sequence import Sequence
from common.model.default_model import resolve_model_path
from common.sampling_params import SamplingParams
from common.tokenizer import Tokenizer
from kernels.sizes import ceil_div

REPO = Path(__file__).resolve().parents[2]
SOURCES = [
    "common/engine/speculative/ngram.py",
    "common/engine/page_manager.py",
    "router/detokenizer.py",
    "common/hashing.py",
    "kvtransfer/messages.py",
    "common/engine/kv_pool.py",
    "router/metrics.py",
    "common/sampling_params.py",
]
# The pages of running prose: enough long paragraphs that no prompt repeats at batch 8.
DOCUMENTS = ["docs/architecture.md", "docs/cpu.md", "docs/deployment.md", "docs/gpu.md"]
PROMPT_TOKENS = 240


def leading_tokens(tokenizer: Tokenizer, text: str) -> str:
    """The first PROMPT_TOKENS tokens of ``text``, as text."""
    return tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)[:PROMPT_TOKENS])


def copy_prompts(tokenizer: Tokenizer, count: int) -> list[list[int]]:
    """Chat prompts asking to copy ~240 tokens of source each, the answer's code block begun."""
    prompts = []
    for index in range(count):
        code = leading_tokens(tokenizer, (REPO / SOURCES[index % len(SOURCES)]).read_text())
        messages = [{"role": "user", "content": f"Copy this code exactly:\n```python\n{code}\n```"}]
        prompts.append(tokenizer.encode_chat(messages) + tokenizer.encode("```python\n"))
    return prompts


def prose_paragraphs() -> list[str]:
    """The documentation's paragraphs of running text (no headings, tables, lists or code),
    in file order, each long enough to fill a prompt."""
    paragraphs = []
    for document in DOCUMENTS:
        for block in (REPO / document).read_text().split("\n\n"):
            if len(block) > 600 and not block.lstrip().startswith(("#", "|", "```", "-", "*")):
                paragraphs.append(block.strip())
    return paragraphs


def rewrite_prompts(tokenizer: Tokenizer, count: int) -> list[list[int]]:
    """Chat prompts asking to return ~240 tokens of documentation with its grammar fixed."""
    paragraphs = prose_paragraphs()
    prompts = []
    for index in range(count):
        text = leading_tokens(tokenizer, paragraphs[index % len(paragraphs)])
        content = f"Fix the grammar of this text and return it whole:\n\n{text}"
        prompts.append(tokenizer.encode_chat([{"role": "user", "content": content}]))
    return prompts


WORKLOADS = {"code": copy_prompts, "text": rewrite_prompts}


def truncated_draft(model: Path, layers: int, folder: Path) -> Path:
    """The target's first ``layers`` decoder layers, final norm and head, as a checkpoint."""
    config = json.loads((model / "config.json").read_text())
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for file in sorted(model.glob("*.safetensors")):
        for name, tensor in load_file(file).items():
            if name.startswith("model.layers.") and int(name.split(".")[2]) >= layers:
                continue
            tensors[name] = tensor.contiguous()
    save_file(tensors, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(config | {"num_hidden_layers": layers}))
    for extra in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (model / extra).exists():
            shutil.copy(model / extra, folder / extra)
    return folder


def make_engine(args, spec: SpeculativeConfig) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=args.model,
            dtype="bfloat16",
            cache=CacheConfig(kv_cache_memory=1 << 30),
            scheduler=SchedulerConfig(max_num_batched_tokens=256, max_model_len=2048),
            speculative=spec,
        )
    )


def decode_rate(engine: LLMEngine, prompts: list[list[int]], max_tokens: int):
    """(decode tokens/s, tokens each sequence gained per step, the tokens) over the steps after
    every prompt's first token."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    tokens: dict[str, list[int]] = {i: [] for i in ids}

    def step() -> None:
        for output in engine.step():
            tokens[output.request_id] += [s.token_id for s in output.new_samples]

    while any(not t for t in tokens.values()):
        step()
    start, decoded = time.perf_counter(), -sum(len(t) for t in tokens.values())
    sequence_steps = 0
    while engine.has_unfinished:
        sequence_steps += len(engine.scheduler.running)
        step()
    elapsed = time.perf_counter() - start
    decoded += sum(len(t) for t in tokens.values())
    return decoded / elapsed, decoded / sequence_steps, [tokens[i] for i in ids]


@dataclass
class Run:
    rate: float  # decode tokens/s
    proposed: float
    accepted: float
    tokens_per_step: float
    tokens: list[list[int]]


def measure(engine: LLMEngine, groups: list[list[list[int]]], max_tokens: int) -> Run:
    """Each group of prompts decoded together, one group after the other."""
    before = counters(engine)
    seconds, decoded, per_step, tokens = 0.0, 0, [], []
    for prompts in groups:
        rate, gained, out = decode_rate(engine, prompts, max_tokens)
        count = sum(len(t) - 1 for t in out)
        decoded, seconds = decoded + count, seconds + count / rate
        per_step.append(gained)
        tokens += out
    proposed, accepted = (a - b for a, b in zip(counters(engine), before, strict=True))
    return Run(decoded / seconds, proposed, accepted, statistics.mean(per_step), tokens)


def counters(engine: LLMEngine) -> tuple[float, float]:
    from common import metrics

    return metrics.SPEC_PROPOSED._value.get(), metrics.SPEC_ACCEPTED._value.get()


def draft_catch_up_vs_shipping(engine: LLMEngine, prompt_tokens: int, repeats: int = 3):
    """Seconds for the draft to prefill a prompt here, and for its pages' bytes to cross a
    loopback ZeroMQ socket."""
    proposer = engine.speculator.proposer
    layout = proposer.pool.layout
    num_pages = ceil_div(prompt_tokens, layout.page_size)
    pages = engine.page_manager.allocate(num_pages)
    prefill = []
    for _ in range(repeats):
        seq = Sequence.from_prompt("probe", list(range(100, 100 + prompt_tokens)), SamplingParams())
        seq.page_ids = pages
        seq.num_computed_tokens = prompt_tokens - 1
        start = time.perf_counter()
        proposer.propose([seq], [1])
        prefill.append(time.perf_counter() - start)
    engine.page_manager.free(pages)
    payload = bytes(num_pages * layout.bytes_per_page)
    context = zmq.Context()
    push, pull = context.socket(zmq.PUSH), context.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push.connect(f"tcp://127.0.0.1:{port}")
    ship = []
    for _ in range(repeats):
        start = time.perf_counter()
        push.send(payload, copy=False)
        pull.recv(copy=False)
        ship.append(time.perf_counter() - start)
    push.close(0)
    pull.close(0)
    context.term()
    return min(prefill), min(ship), len(payload)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    add_core_argument(parser)
    parser.add_argument("-k", "--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--draft-layers", type=int, default=4)
    parser.add_argument("--draft-dir", default="/tmp/pdserve-draft")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--rounds", type=int, default=3, help="alternating runs per engine")
    parser.add_argument("--workloads", default="code,text", help=f"of {', '.join(WORKLOADS)}")
    args = parser.parse_args()
    unknown = set(args.workloads.split(",")) - set(WORKLOADS)
    if unknown:
        parser.error(f"unknown workload {', '.join(sorted(unknown))}: choose from {set(WORKLOADS)}")
    pin_to_cores({args.core})
    model = resolve_model_path(args.model)
    args.model = str(model)
    tokenizer = Tokenizer(model)
    draft = truncated_draft(model, args.draft_layers, Path(args.draft_dir))
    k = args.num_speculative_tokens
    configs = {
        "plain": SpeculativeConfig(),
        f"ngram k={k}": SpeculativeConfig(method="ngram", num_speculative_tokens=k),
        f"draft {args.draft_layers}L k={k}": SpeculativeConfig(
            method="draft", model=str(draft), num_speculative_tokens=k
        ),
    }
    engines = {name: make_engine(args, spec) for name, spec in configs.items()}
    print(f"model {model.name}, bf16, one core (#{args.core}); prompts of ~{PROMPT_TOKENS + 30}")
    print(f"tokens, {args.max_tokens} greedy tokens each\n")
    print(f"{'':27s}{'decode tok/s':>14s}{'vs plain':>10s}{'accepted':>10s}{'tokens/step':>13s}")
    cases = [
        (workload, int(batch))
        for workload in args.workloads.split(",")
        for batch in args.batches.split(",")
    ]
    for workload, batch in cases:
        # Batch 1 runs two prompts alone in turn. Rounds alternate the engines and each one's
        # figure is its median round, so a noisy neighbour hits all of them alike.
        make_prompts = WORKLOADS[workload]
        if batch == 1:
            groups = [[prompt] for prompt in make_prompts(tokenizer, 2)]
        else:
            groups = [make_prompts(tokenizer, batch)]
        runs: dict[str, list[Run]] = {name: [] for name in engines}
        for _ in range(args.rounds):
            for name, engine in engines.items():
                runs[name].append(measure(engine, groups, args.max_tokens))
        plain_rate = statistics.median(run.rate for run in runs["plain"])
        for name, measured in runs.items():
            rate = statistics.median(run.rate for run in measured)
            proposed = sum(run.proposed for run in measured)
            accepted = sum(run.accepted for run in measured)
            per_step = statistics.mean(run.tokens_per_step for run in measured)
            same = "" if measured[0].tokens == runs["plain"][0].tokens else "  (TOKENS DIFFER)"
            acceptance = f"{accepted / proposed:9.0%}" if proposed else f"{'-':>9s}"
            print(
                f"{workload:4s} batch {batch:<2d} {name:14s}{rate:14.1f}{rate / plain_rate:9.2f}x"
                f"{acceptance} {per_step:12.2f}{same}"
            )
        print()
    draft_engine = engines[f"draft {args.draft_layers}L k={k}"]
    prefill, ship, nbytes = draft_catch_up_vs_shipping(draft_engine, PROMPT_TOKENS + 30)
    print(
        f"draft prompt KV for {PROMPT_TOKENS + 30} tokens ({nbytes / 1e6:.2f} MB): prefilled "
        f"here {prefill * 1e3:.1f} ms, shipped over loopback ZeroMQ {ship * 1e3:.1f} ms"
    )
    print("tokens/step: what each decoding sequence gained per step, on average")


if __name__ == "__main__":
    main()
