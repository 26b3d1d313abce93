"""8-bit KV caches against bf16 KV, measured as llama.cpp measures them (``llama-perplexity
--kl-divergence``): the same text, teacher-forced, through each cache, and each position's
next-token distribution compared with the bf16 KV one.

Teacher forcing feeds every position the text's true previous tokens, so one early flip does not
decide the rest (greedy agreement saturates: see ``benchmarks/quality/fp8_kv.py``). The text is
held out: Python's own reference manual (``pydoc_data.topics``, shipped with every Python), not
pdserve's. It is cut into segments decoded side by side: each segment's first ``--context``
tokens are prefilled in chunks through the paged cache, then every later position is decoded one
token at a time over the pages (one decode row per segment, so a step is a batch of segments),
and its logits are scored. Every format runs the engine as it serves: its own pool, its own
stores and attention backend (the C kernels on a CPU), and ``--kv-cache-dtype int8`` with its
Hadamard turns.

The formats: bf16 KV (the reference), ``fp8`` (vLLM's meaning: e4m3 with a scale per token and
KV head) and ``int8`` (int8 after a Hadamard turn, a one-byte scale). The rounding row keeps bf16
KV and reads the very same pages with another attention kernel (the portable torch backend's
SDPA instead of the C kernel): attention changes only by float32 rounding, so that row is what
the metric cannot resolve. Per format, one line a script can read::

    kv int8: kld_mean X kld_p99 Y top1 Z% ppl_ratio R

e.g. on SmolLM2, ``--tokens 512 --segment 128 --context 32 --chunk 16``::

    kv int8: kld_mean 0.002125 kld_p99 0.00796 top1 97.63% ppl_ratio 0.99278

KL divergence is KL(bf16 || format) in nats per position, top-1 the share of positions whose
most likely token is bf16's, ppl_ratio the format's perplexity of the text over bf16's.

    python -m benchmarks.quality.kv_quality [--model PATH | --qwen2] [--tokens 16384]
        [--segment 512]
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from benchmarks.harness import qwen2_with_key_outliers
from common.config import CacheConfig, EngineConfig, SchedulerConfig
from common.engine.batch import TokenRun, flatten_runs
from common.engine.llm_engine import LLMEngine
from common.tokenizer import Tokenizer
from kernels.sizes import ceil_div
from kernels.torch_backend import TorchAttentionBackend

REFERENCE = "bf16"
ROUNDING = "rounding"  # bf16 KV, the portable torch backend's attention


@dataclass(frozen=True)
class KVFormat:
    """One way of keeping and reading the KV cache: an engine's ``--kv-cache-dtype`` and whether
    its pages are attended by the portable torch backend instead of the engine's own."""

    kv_cache_dtype: str
    torch_attention: bool = False


FORMATS = {
    REFERENCE: KVFormat("auto"),
    ROUNDING: KVFormat("auto", torch_attention=True),
    "fp8": KVFormat("fp8"),
    "int8": KVFormat("int8"),
}


@dataclass(frozen=True)
class Segments:
    """The text cut into segments of equal length, decoded side by side."""

    token_ids: list[list[int]]
    context: int  # leading tokens of each segment prefilled before decoding starts
    chunk: int  # prefill chunk, tokens per segment

    def __post_init__(self) -> None:
        lengths = {len(segment) for segment in self.token_ids}
        if len(lengths) != 1:
            raise ValueError(f"segments of different lengths: {sorted(lengths)}")
        if not 1 <= self.context <= self.length - 2:
            raise ValueError(
                f"context {self.context} leaves no position to score in {self.length} tokens"
            )
        if self.chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {self.chunk}")

    @property
    def length(self) -> int:
        return len(self.token_ids[0])

    @property
    def decode_positions(self) -> range:
        """The positions decoded and scored: each one's logits predict the next token."""
        return range(self.context, self.length - 1)

    @property
    def num_scored(self) -> int:
        return len(self.token_ids) * len(self.decode_positions)


def cut_segments(token_ids: list[int], segment: int, context: int, chunk: int) -> Segments:
    """As many whole segments of ``segment`` tokens as ``token_ids`` holds."""
    count = len(token_ids) // segment
    if count < 1:
        raise ValueError(f"{len(token_ids)} tokens do not fill one segment of {segment}")
    return Segments(
        [token_ids[i * segment : (i + 1) * segment] for i in range(count)], context, chunk
    )


def held_out_text() -> str:
    """Python's reference manual as ``pydoc`` ships it (about 460,000 characters)."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in sorted(topics))


def build_engine(
    model: str, kv_format: KVFormat, segments: Segments, dtype: str = "bfloat16"
) -> LLMEngine:
    """An engine whose pool holds every segment at once, its step every segment's chunk."""
    page_size = CacheConfig().page_size
    engine = LLMEngine(
        EngineConfig(
            model=model,
            dtype=dtype,
            cache=CacheConfig(
                kv_cache_dtype=kv_format.kv_cache_dtype,
                num_pages=len(segments.token_ids) * ceil_div(segments.length, page_size),
                enable_prefix_caching=False,
            ),
            scheduler=SchedulerConfig(
                max_num_batched_tokens=len(segments.token_ids) * segments.chunk,
                max_num_seqs=len(segments.token_ids),
                max_model_len=segments.length,
            ),
        )
    )
    if kv_format.torch_attention:
        engine.model.bind_kv(engine.pool, TorchAttentionBackend())
    return engine


class TeacherForced:
    """One engine fed the text's own tokens: its pages hold every segment, and each forward is
    the runner's own (``flatten_runs`` metadata, the bound backend's stores and attention)."""

    def __init__(self, engine: LLMEngine, segments: Segments) -> None:
        self.engine = engine
        self.segments = segments
        page_size = engine.pool.layout.page_size
        self.page_ids = [
            engine.page_manager.allocate(ceil_div(segments.length, page_size))
            for _ in segments.token_ids
        ]
        self.vocab_size = engine.model_config.vocab_size

    def _forward(self, start: int, end: int, num_logits: int) -> torch.Tensor:
        runs = [
            TokenRun(tokens[start:end], start, pages, num_logits)
            for tokens, pages in zip(self.segments.token_ids, self.page_ids, strict=True)
        ]
        inputs = flatten_runs(runs, self.engine.pool.layout.page_size, self.engine.device)
        logits = self.engine.model(
            inputs.input_ids, inputs.positions, inputs.meta, inputs.logits_indices
        )
        return logits[:, : self.vocab_size]

    @torch.inference_mode()
    def prefill(self) -> None:
        """Store each segment's context in the pages, ``chunk`` tokens of every segment a step;
        each chunk attends to the ones before it through the pages."""
        context, chunk = self.segments.context, self.segments.chunk
        for start in range(0, context, chunk):
            self._forward(start, min(start + chunk, context), 0)

    @torch.inference_mode()
    def decode(self, position: int) -> torch.Tensor:  # [num_segments, vocab] float64
        """Decode ``position`` of every segment over its pages (its KV stored like any decode
        step's): the log-probabilities of the token after it."""
        logits = self._forward(position, position + 1, 1)
        return torch.log_softmax(logits.double(), dim=-1)


@dataclass
class Tally:
    """One format's scores against the reference, position by position."""

    klds: list[torch.Tensor] = field(default_factory=list)
    agree: int = 0
    nll: float = 0.0
    count: int = 0
    seconds: float = 0.0

    def add(self, reference: torch.Tensor, logprobs: torch.Tensor, targets: torch.Tensor) -> None:
        self.klds.append((reference.exp() * (reference - logprobs)).sum(-1))
        self.agree += int((reference.argmax(-1) == logprobs.argmax(-1)).sum())
        self.nll -= float(logprobs.gather(-1, targets[:, None]).sum())
        self.count += len(targets)

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll / self.count)


@dataclass(frozen=True)
class Quality:
    name: str
    kld_mean: float
    kld_p99: float
    top1: float  # share of positions, 0..1
    perplexity: float
    ppl_ratio: float
    seconds: float

    def line(self) -> str:
        return (
            f"kv {self.name}: kld_mean {self.kld_mean:.4g} kld_p99 {self.kld_p99:.4g} "
            f"top1 {self.top1:.2%} ppl_ratio {self.ppl_ratio:.5f}"
        )


def measure(
    engines: dict[str, LLMEngine],
    segments: Segments,
    progress: Callable[[int], None] | None = None,
    reference_name: str = REFERENCE,
) -> list[Quality]:
    """Teacher-force ``segments`` through every engine in step and score each against the
    ``reference_name`` one's distributions; the reference itself scores KLD 0 and top-1 100%.
    ``progress`` hears how many positions are done after each."""
    if reference_name not in engines:
        raise ValueError(f"no {reference_name!r} engine to compare with")
    runners = {name: TeacherForced(engine, segments) for name, engine in engines.items()}
    tallies = {name: Tally() for name in engines}

    def timed(
        name: str, work: Callable[..., torch.Tensor | None], *args: int
    ) -> torch.Tensor | None:
        started = time.perf_counter()
        result = work(*args)
        tallies[name].seconds += time.perf_counter() - started
        return result

    for name, runner in runners.items():
        timed(name, runner.prefill)
    for done, position in enumerate(segments.decode_positions, 1):
        targets = torch.tensor([tokens[position + 1] for tokens in segments.token_ids])
        logprobs = {name: timed(name, runner.decode, position) for name, runner in runners.items()}
        reference = logprobs[reference_name]
        assert reference is not None
        for name, tally in tallies.items():
            other = logprobs[name]
            assert other is not None
            tally.add(reference, other, targets)
        if progress is not None:
            progress(done)
    reference_ppl = tallies[reference_name].perplexity
    qualities = []
    for name, tally in tallies.items():
        klds = torch.cat(tally.klds).clamp_min(0.0)  # float64 rounding can dip below zero
        qualities.append(
            Quality(
                name,
                float(klds.mean()),
                float(torch.quantile(klds, 0.99)),
                tally.agree / tally.count,
                tally.perplexity,
                tally.perplexity / reference_ppl,
                tally.seconds,
            )
        )
    return qualities


def gemm_kernels(engine: LLMEngine) -> str:
    """Which GEMMs the engine's linear layers run: every format should run the same ones, so
    that its logits differ from bf16 KV's by its KV alone."""
    head = engine.model.head
    plan = getattr(head, "plan", None)
    return plan.describe() if plan is not None else type(head).__name__ if head else "torch"


def progress_to_stderr(total: int) -> Callable[[int], None]:
    """A run takes minutes: say so every tenth of the way."""

    def report(done: int) -> None:
        if done % max(1, total // 10) == 0 or done == total:
            print(f"decoded {done} of {total} positions", file=sys.stderr, flush=True)

    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--qwen2", action="store_true", help="the Qwen2 shape with outliers")
    parser.add_argument("--tokens", type=int, default=16384, help="tokens of text to read")
    parser.add_argument("--segment", type=int, default=512, help="tokens per segment")
    parser.add_argument("--context", type=int, default=128, help="tokens prefilled per segment")
    parser.add_argument("--chunk", type=int, default=64, help="prefill chunk per segment")
    args = parser.parse_args()
    from common.model.default_model import resolve_model_path

    folder = resolve_model_path(args.model)
    tokenizer = Tokenizer(folder)
    text_ids = tokenizer.encode(held_out_text(), add_special_tokens=False)
    if len(text_ids) < args.tokens:
        raise SystemExit(f"the text has {len(text_ids)} tokens, fewer than --tokens")
    segments = cut_segments(text_ids[: args.tokens], args.segment, args.context, args.chunk)
    with tempfile.TemporaryDirectory() as scratch:
        model = str(folder)
        if args.qwen2:
            model = str(qwen2_with_key_outliers(Path(scratch), folder))
        engines = {name: build_engine(model, kv, segments) for name, kv in FORMATS.items()}
        qualities = measure(engines, segments, progress_to_stderr(len(segments.decode_positions)))
    shape = "Qwen2 shape, 2 KV heads of 128, key outliers" if args.qwen2 else folder.name
    count = len(segments.token_ids)
    print(
        f"{shape}: pydoc_data.topics, {count} segments x {segments.length} tokens "
        f"({count * segments.length} tokens), {segments.context} prefilled in chunks of "
        f"{segments.chunk}, {segments.num_scored} positions decoded and scored; bf16 weights"
    )
    kernels = {gemm_kernels(engine) for engine in engines.values()}
    print(f"linear layers: {' / '.join(sorted(kernels))}")
    print(
        "perplexity: "
        + ", ".join(f"{q.name} {q.perplexity:.4f} ({q.seconds:.0f} s)" for q in qualities)
    )
    for quality in qualities:
        if quality.name != REFERENCE:
            print(quality.line())


if __name__ == "__main__":
    main()
