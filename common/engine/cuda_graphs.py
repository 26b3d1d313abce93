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
verification, prompt logprobs) runs eagerly.

With LoRA adapters a second graph per size is captured with every projection's batched LoRA
kernels in it, launched over one segment per row (``LoraSegments.of_graph``): a replay writes
each row's slot and bounds (empty for the base model's rows and padding) into static buffers,
so one graph serves any mix of adapters. A step with no adapter row replays the base graph,
which has no LoRA launches at all. ``StaticDecodeBatch`` (the buffers and the
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
from kernels.lora import LoraSegments
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
        # Each row's LoRA segment: its first row, one past its last (itself, or empty), slot.
        self.lora_rows = torch.zeros((3, max_batch), dtype=torch.int32, device=device)

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

    def lora_segments(self, size: int) -> LoraSegments:
        """The LoRA segments of a batch of ``size`` rows, views of the buffers as ``inputs``."""
        starts, ends, slots = self.lora_rows[:, :size]
        return LoraSegments.of_graph(starts, ends, slots)

    def load_lora(self, segments: LoraSegments, size: int) -> None:
        """Write each row's segment from a decode step's ``segments`` (one row a sequence),
        every other row of the ``size`` an empty one."""
        rows = list(range(size))
        ends, slots = list(rows), [0] * size
        for start, end, slot in zip(segments.starts, segments.ends, segments.slots, strict=True):
            for row in range(start, end):
                ends[row], slots[row] = row + 1, slot
        table = torch.tensor([rows, ends, slots], dtype=torch.int32)
        self.lora_rows[:, :size].copy_(table, non_blocking=True)

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
        """Rows ``start:end`` decode token 0 at position 0 over page 0 and store nothing, under
        no adapter."""
        self.input_ids[start:end] = 0
        self.positions[start:end] = 0
        self.seq_lens[start:end] = 1
        self.page_tables[start:end, 0] = 0
        self.slot_mapping[start:end] = -1
        self.lora_rows[0, start:end] = self.lora_rows[1, start:end] = torch.arange(
            start, end, dtype=torch.int32, device=self.lora_rows.device
        )
        self.lora_rows[2, start:end] = 0


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
        adapters: bool = False,
    ) -> None:
        """``adapters``: the model has LoRA slots, so each size gets an adapter graph too."""
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {device}")
        self.model = model
        self.sizes = sorted(sizes)
        self.adapters = adapters
        self.batch = StaticDecodeBatch(self.sizes[-1], max_model_len, page_size, device)
        # (size, whether under adapters) -> the graph and its output.
        self._graphs: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.replays = 0

    @torch.inference_mode()
    def capture(self) -> None:
        """Record every size, largest first so the smaller ones reuse its memory pool. Every
        row is padding during capture: nothing is written to the KV pool."""
        started = time.monotonic()
        before = torch.cuda.memory_reserved()
        pool = torch.cuda.graph_pool_handle()
        self.batch.pad(0, self.batch.max_batch)
        kinds = (False, True) if self.adapters else (False,)
        for size in reversed(self.sizes):
            for under_adapters in kinds:
                inputs = self.batch.inputs(size)
                lora = self.batch.lora_segments(size) if under_adapters else None
                # Warm-up on a side stream, as capture requires: Triton compiles its kernels
                # and cuBLAS sets up its workspaces outside the recording.
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    for _ in range(2):
                        self._forward(inputs, lora)
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                # thread_local: a worker's other threads (KV transfer) may use the GPU.
                with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                    logits = self._forward(inputs, lora)
                self._graphs[size, under_adapters] = (graph, logits)
        torch.cuda.synchronize()
        logger.info(
            "CUDA graphs of decode batches of %s sequences%s, captured in %.1f s (%.0f MiB)",
            ", ".join(map(str, self.sizes)),
            ", each also under LoRA adapters" if self.adapters else "",
            time.monotonic() - started,
            (torch.cuda.memory_reserved() - before) / 2**20,
        )

    def _forward(self, inputs: ForwardInputs, lora: LoraSegments | None) -> torch.Tensor:
        return self.model(
            inputs.input_ids, inputs.positions, inputs.meta, inputs.logits_indices, lora
        )

    def run(self, inputs: ForwardInputs, lora: LoraSegments | None = None) -> torch.Tensor | None:
        """The step's logits ``[num_seqs, vocab]`` from a replay, or None (run it eagerly);
        ``lora``: the step's rows under adapters (None: none)."""
        if not self._graphs or not self.batch.fits(inputs):
            return None
        if lora is not None and not self.adapters:
            return None
        num_seqs = inputs.meta.num_seqs
        size = next(size for size in self.sizes if size >= num_seqs)
        self.batch.load(inputs, size)
        if lora is not None:
            self.batch.load_lora(lora, size)
        graph, logits = self._graphs[size, lora is not None]
        graph.replay()
        self.replays += 1
        # A copy: the next replay overwrites the graph's output.
        return logits[:num_seqs].clone()
