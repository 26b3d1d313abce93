"""A draft model proposes by decoding greedily ahead of the target.

The draft keeps its own KV pool with as many pages as the target's and writes each sequence's
KV into the pages of the same ids, so the target's page tables serve both models and nothing
is allocated twice. The draft computes its KV here, on the decode worker, from whatever the
sequence holds: a prompt whose target KV was shipped from a prefill worker is caught up by the
draft in its first proposing steps (a draft is a small fraction of the target, so this costs
less than shipping a second model's pages would; ``benchmarks/step/speculative.py`` measures it).
``SpeculationState.draft_fed_tokens`` says how far a sequence's draft KV reaches; after
verification it is valid only up to the sequence's computed tokens, since a rejected proposal
was fed at the position that now holds the target's correction.

Proposals are greedy: the target's verification keeps its own distribution whatever the draft
proposes (``speculator.py``), and one-hot proposals make that verification exact.
"""

from __future__ import annotations

import torch

from common.engine.batch import HostStaging, PageTables, TokenRun, flatten_runs
from common.engine.kv_pool import KVPool
from common.engine.sequence import Sequence
from common.model.llama import LlamaForCausalLM
from kernels.argmax import argmax_rows


class DraftModelProposer:
    def __init__(
        self,
        model: LlamaForCausalLM,
        pool: KVPool,
        vocab_size: int,
        max_catch_up_tokens: int,
    ) -> None:
        """``model`` is bound to ``pool``; proposals are limited to the target's
        ``vocab_size``; ``max_catch_up_tokens`` bounds the prompt tokens the draft computes
        per step (a long shipped prompt is caught up over several steps, speculating only
        once it is)."""
        self.model = model
        self.pool = pool
        self.vocab_size = vocab_size
        self.max_catch_up_tokens = max_catch_up_tokens
        self.page_size = pool.layout.page_size
        self.device = pool.device
        self.staging = HostStaging()
        self.page_tables = PageTables()

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> list[list[int]]:
        proposals: list[list[int]] = [[] for _ in seqs]
        # The first forward feeds each sequence everything its draft KV lacks, up to its last
        # token, whose logits give the first proposal.
        runs, ready, budget = [], [], self.max_catch_up_tokens
        for i, seq in enumerate(seqs):
            state = seq.speculation
            start = min(state.draft_fed_tokens, seq.num_computed_tokens)
            missing = seq.num_tokens - start
            if missing > 1:
                take = min(missing, max(budget, 0))
                budget -= take
            else:
                take = missing
            if take == 0:
                continue
            complete = take == missing
            fed = seq.token_ids[start : start + take]
            runs.append(TokenRun(fed, start, seq.page_ids, num_logits=int(complete)))
            state.draft_fed_tokens = start + take
            if complete:
                ready.append(i)
        if not runs:
            return proposals
        for i, token in zip(ready, self._greedy(runs), strict=True):
            proposals[i].append(token)
        # Each later forward feeds the newest proposal of every sequence that wants another.
        while True:
            wanting = [i for i in ready if len(proposals[i]) < num_tokens[i]]
            if not wanting:
                return proposals
            runs = []
            for i in wanting:
                seq = seqs[i]
                position = seq.speculation.draft_fed_tokens
                runs.append(TokenRun([proposals[i][-1]], position, seq.page_ids, 1))
                seq.speculation.draft_fed_tokens = position + 1
            for i, token in zip(wanting, self._greedy(runs), strict=True):
                proposals[i].append(token)

    def _greedy(self, runs: list[TokenRun]) -> list[int]:
        inputs = flatten_runs(runs, self.page_size, self.device, self.staging, self.page_tables)
        logits = self.model(inputs.input_ids, inputs.positions, inputs.meta, inputs.logits_indices)
        return argmax_rows(logits[:, : self.vocab_size]).tolist()
