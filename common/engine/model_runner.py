"""Runs one forward over a scheduled batch and samples the next token of every finishing row."""

from __future__ import annotations

import torch

from common.engine.kv_pool import KVPool
from common.engine.sampler import SampledToken, Sampler, SamplingRow
from common.engine.scheduler import ScheduledSequence
from common.model.llama import LlamaForCausalLM
from kernels.interface import AttentionBackend, AttentionMetadata


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        pool: KVPool,
        backend: AttentionBackend,
        sampler: Sampler,
    ) -> None:
        self.model = model
        self.pool = pool
        self.backend = backend
        self.sampler = sampler
        self.device = pool.device
        self.block_size = pool.layout.block_size

    @torch.inference_mode()
    def run(self, batch: list[ScheduledSequence]) -> list[SampledToken]:
        """Forward ``batch``; returns one sampled token per row whose ``samples`` is true."""
        if not batch:
            return []
        input_ids, positions, meta, logits_indices = self.prepare(batch)
        logits = self.model(input_ids, positions, meta, logits_indices)
        rows = [
            SamplingRow(item.seq.params, item.seq.prompt_token_ids, item.seq.output_token_ids)
            for item in batch
            if item.samples
        ]
        return self.sampler.sample(logits, rows) if rows else []

    def prepare(
        self, batch: list[ScheduledSequence]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """Flatten the batch into token ids, positions and explicit attention metadata."""
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        logits_indices: list[int] = []
        max_blocks = 0
        for item in batch:
            seq, start = item.seq, item.seq.num_computed_tokens
            end = start + item.num_new_tokens
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            blocks = seq.block_ids
            slots.extend(
                blocks[pos // self.block_size] * self.block_size + pos % self.block_size
                for pos in range(start, end)
            )
            query_start_loc.append(query_start_loc[-1] + item.num_new_tokens)
            seq_lens.append(end)
            if item.samples:
                logits_indices.append(query_start_loc[-1] - 1)
            max_blocks = max(max_blocks, len(blocks))
        block_tables = torch.zeros((len(batch), max_blocks), dtype=torch.int32)
        for row, item in enumerate(batch):
            block_tables[row, : len(item.seq.block_ids)] = torch.tensor(
                item.seq.block_ids, dtype=torch.int32
            )

        def tensor(values: list[int], dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)

        meta = AttentionMetadata(
            query_start_loc=tensor(query_start_loc, torch.int32),
            seq_lens=tensor(seq_lens, torch.int32),
            block_tables=block_tables.to(self.device, non_blocking=True),
            slot_mapping=tensor(slots, torch.int64),
            max_query_len=max(item.num_new_tokens for item in batch),
            max_seq_len=max(seq_lens),
        )
        return (
            tensor(input_ids, torch.long),
            tensor(positions, torch.long),
            meta,
            tensor(logits_indices, torch.long),
        )
