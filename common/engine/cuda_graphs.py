"""CUDA graphs of the decode step: the whole forward recorded once per batch size, replayed in
one launch.

A decode step launches a dozen kernels a layer, each costing microseconds of host time while
the GPU's share of a small batch is microseconds too, so eager decode is bound by launches.
A graph per batch size records them once. A step runs in the smallest captured size that
holds it: its rows are copied into static input buffers, and the padding rows behind them
decode token 0 at position 0 over page 0, where they only read (their slot is -1, which the
Triton store skips), and their logits are dropped.

Graphed: pure decode steps (one token and one logits row per sequence) on CUDA with the Triton
backend, up to the largest captured size. Anything else (prefill chunks, speculative
verification, prompt logprobs) runs eagerly. ``StaticDecodeBatch`` (the buffers and the
padding) is device-neutral so that its behaviour is tested without a GPU; ``DecodeGraphs``
captures and replays.
"""

from __future__ import annotations

import logging
import time

import torch

from common.engine.batch import ForwardInputs
from common.model.llama import LlamaForCausalLM
from kernels.interface import AttentionMetadata
from kernels.sizes import ceil_div

logger = logging.getLogger(__name__)

# Batch sizes to capture, up to the engine's --max-num-seqs: every power of two, then steps of
# 64 (a step pads to the next size, so the gaps bound the padding at a third).
_CAPTURE_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 320, 384, 448, 512)


def capture_sizes(max_num_seqs: int) -> list[int]:
    sizes = [size for size in _CAPTURE_SIZES if size < max_num_seqs]
    return [*sizes, min(max_num_seqs, _CAPTURE_SIZES[-1])]


class StaticDecodeBatch:
    """Input buffers for decode batches of up to ``max_batch`` sequences of up to
    ``max_model_len`` tokens; ``load`` fills the first rows and pads the rest."""

    def __init__(
        self, max_batch: int, max_model_len: int, page_size: int, device: torch.device
    ) -> None:
        self.max_batch = max_batch
        self.max_model_len = max_model_len
        self.max_pages = ceil_div(max_model_len, page_size)
        rows = torch.arange(max_batch + 1, dtype=torch.int32, device=device)
        self.input_ids = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(max_batch, dtype=torch.int32, device=device)
        self.page_tables = torch.zeros(
            (max_batch, self.max_pages), dtype=torch.int32, device=device
        )
        self.slot_mapping = torch.full((max_batch,), -1, dtype=torch.long, device=device)
        self.query_start_loc = rows  # one token per sequence: row i starts at token i
        self.logits_indices = rows[:max_batch].long()

    def fits(self, inputs: ForwardInputs) -> bool:
        """Whether ``inputs`` is a decode step these buffers can hold."""
        meta = inputs.meta
        num_seqs = meta.num_seqs
        return (
            meta.max_query_len == 1
            and inputs.input_ids.shape[0] == num_seqs
            and inputs.logits_indices.shape[0] == num_seqs
            and 0 < num_seqs <= self.max_batch
            and meta.page_tables.shape[1] <= self.max_pages
            and meta.max_seq_len <= self.max_model_len
        )

    def inputs(self, size: int) -> ForwardInputs:
        """The forward's inputs for a batch of ``size`` rows: views of the buffers, so a graph
        captured over them reads whatever ``load`` puts there later."""
        meta = AttentionMetadata(
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            page_tables=self.page_tables[:size],
            slot_mapping=self.slot_mapping[:size],
            max_query_len=1,
            # The decode kernel splits long contexts by this: a graph keeps the split it was
            # captured with, so it is captured for the longest context.
            max_seq_len=self.max_model_len,
        )
        return ForwardInputs(
            self.input_ids[:size], self.positions[:size], meta, self.logits_indices[:size]
        )

    def load(self, inputs: ForwardInputs, size: int) -> None:
        """Copy a decode step's rows in (on the device, no host sync) and pad up to ``size``."""
        meta = inputs.meta
        n, width = meta.num_seqs, meta.page_tables.shape[1]
        self.input_ids[:n].copy_(inputs.input_ids)
        self.positions[:n].copy_(inputs.positions)
        self.seq_lens[:n].copy_(meta.seq_lens)
        # Entries past a row's width are stale but never read: its pages end before them.
        self.page_tables[:n, :width].copy_(meta.page_tables)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        if size > n:
            self.pad(n, size)

    def pad(self, start: int, end: int) -> None:
        """Rows ``start:end`` decode token 0 at position 0 over page 0 and store nothing."""
        self.input_ids[start:end] = 0
        self.positions[start:end] = 0
        self.seq_lens[start:end] = 1
        self.page_tables[start:end, 0] = 0
        self.slot_mapping[start:end] = -1


class DecodeGraphs:
    """One CUDA graph of ``model``'s forward per batch size; ``run`` replays the smallest that
    holds a step, ``None`` where a step is not for a graph."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        sizes: list[int],
        max_model_len: int,
        page_size: int,
        device: torch.device,
    ) -> None:
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {device}")
        self.model = model
        self.sizes = sorted(sizes)
        self.batch = StaticDecodeBatch(self.sizes[-1], max_model_len, page_size, device)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.replays = 0

    @torch.inference_mode()
    def capture(self) -> None:
        """Record every size, largest first so the smaller ones reuse its memory pool. Every
        row is padding during capture: nothing is written to the KV pool."""
        started = time.monotonic()
        before = torch.cuda.memory_reserved()
        pool = torch.cuda.graph_pool_handle()
        self.batch.pad(0, self.batch.max_batch)
        for size in reversed(self.sizes):
            inputs = self.batch.inputs(size)
            # Warm-up on a side stream, as capture requires: Triton compiles its kernels and
            # cuBLAS sets up its workspaces outside the recording.
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self._forward(inputs)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            # thread_local: a worker's other threads (KV transfer) may use the GPU meanwhile.
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                logits = self._forward(inputs)
            self._graphs[size] = (graph, logits)
        torch.cuda.synchronize()
        logger.info(
            "CUDA graphs of decode batches of %s sequences, captured in %.1f s (%.0f MiB)",
            ", ".join(map(str, self.sizes)),
            time.monotonic() - started,
            (torch.cuda.memory_reserved() - before) / 2**20,
        )

    def _forward(self, inputs: ForwardInputs) -> torch.Tensor:
        return self.model(inputs.input_ids, inputs.positions, inputs.meta, inputs.logits_indices)

    def run(self, inputs: ForwardInputs) -> torch.Tensor | None:
        """The step's logits ``[num_seqs, vocab]`` from a replay, or None (run it eagerly)."""
        if not self._graphs or not self.batch.fits(inputs):
            return None
        num_seqs = inputs.meta.num_seqs
        size = next(size for size in self.sizes if size >= num_seqs)
        self.batch.load(inputs, size)
        graph, logits = self._graphs[size]
        graph.replay()
        self.replays += 1
        # A copy: the next replay overwrites the graph's output.
        return logits[:num_seqs].clone()
