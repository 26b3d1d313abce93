"""Runs one forward over a scheduled batch and samples the next token of every finishing row."""

from __future__ import annotations

import torch

from common.engine.kv_pool import KVPool
from common.engine.sampler import SampledToken, Sampler, SamplingRow
from common.engine.scheduler import ScheduledSequence
from common.model.llama import LlamaForCausalLM
from kernels.interface import AttentionMetadata


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        pool: KVPool,
        sampler: Sampler,
    ) -> None:
        self.model = model
        self.pool = pool
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
        """Flatten the batch into token ids, positions and explicit attention metadata: Python
        per sequence, then a handful of tensor ops for every token at once."""
        input_ids: list[int] = []
        query_lens: list[int] = []
        starts: list[int] = []  # the first new position of each sequence
        tables: list[list[int]] = []
        logits_indices: list[int] = []
        num_tokens = 0
        for item in batch:
            seq, start = item.seq, item.seq.num_computed_tokens
            input_ids += seq.token_ids[start : start + item.num_new_tokens]
            query_lens.append(item.num_new_tokens)
            starts.append(start)
            tables.append(seq.block_ids)
            num_tokens += item.num_new_tokens
            if item.samples:
                logits_indices.append(num_tokens - 1)
        width = max(map(len, tables))
        block_tables = torch.tensor(
            [table + [0] * (width - len(table)) for table in tables], dtype=torch.int32
        )
        lens = torch.tensor(query_lens)
        first = torch.tensor(starts)
        query_start_loc = torch.zeros(len(batch) + 1, dtype=torch.int32)
        torch.cumsum(lens, 0, out=query_start_loc[1:])
        # Each token's sequence, then its position: its offset in the sequence's run plus the
        # run's first position.
        owner = torch.repeat_interleave(torch.arange(len(batch)), lens)
        positions = torch.arange(num_tokens) - query_start_loc[:-1][owner] + first[owner]
        pages = block_tables[owner, positions // self.block_size].long()
        slots = pages * self.block_size + positions % self.block_size
        seq_lens = first + lens

        def device(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
            return values.to(self.device, dtype, non_blocking=True)

        meta = AttentionMetadata(
            query_start_loc=device(query_start_loc, torch.int32),
            seq_lens=device(seq_lens, torch.int32),
            block_tables=device(block_tables, torch.int32),
            slot_mapping=device(slots, torch.int64),
            max_query_len=max(query_lens),
            max_seq_len=max(start + n for start, n in zip(starts, query_lens, strict=True)),
        )
        return (
            device(torch.tensor(input_ids), torch.long),
            device(positions, torch.long),
            meta,
            device(torch.tensor(logits_indices, dtype=torch.long), torch.long),
        )
