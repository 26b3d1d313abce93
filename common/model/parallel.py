"""Tensor parallelism inside one worker, Megatron-style: which slice of each weight a rank holds,
and the collectives its forward needs.

With ``size`` ranks, rank ``r`` holds

- the query heads ``heads(num_heads)`` and the KV heads ``kv_heads(num_kv_heads)`` of every
  layer: the columns of QKV for those heads, the rows of O's input for its query heads. Where
  there are fewer KV heads than ranks, each KV head is held (replicated) by ``size /
  num_kv_heads`` neighbouring ranks, whose query heads all read it;
- the slice ``part(intermediate_size)`` of gate/up's columns and down's input rows;
- of a mixture of experts, every expert's slice ``expert_part(width)`` of its width, as a dense
  MLP's; or, with expert parallelism (``--enable-expert-parallel``), the whole experts
  ``experts(num_experts)``, a contiguous share of them. Every rank holds every token's hidden
  state, so each computes its experts' share for the tokens that chose them and the MLP's one
  all-reduce is the exchange: no expert's weights are split, and a rank reads only its own;
- the rows ``vocab_rows(vocab_size)`` of the embedding and the output head, each rank
  ``ceil(vocab / size)`` rows, the last one padded with zero rows.

O and down each end in one all-reduce (their inputs are split, so each rank holds a partial
sum of the output); the embedding is a masked lookup plus an all-reduce; the head's logits are
all-gathered. Norms and RoPE are replicated.

Deterministic inference keeps the sum's order fixed: ``all_reduce`` then all-gathers every
rank's partial sum and adds them up in rank order, ``((p0 + p1) + p2) + ...``, on every rank,
so the result is the same bits on every rank and in every step, whatever algorithm the
backend's own all-reduce would have picked for that size.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import cast

import torch
import torch.distributed as dist

from common.config import ModelConfig
from kernels.sizes import ceil_div

# One collective may wait this long for the slowest rank: longer than any forward a rank runs.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)


@dataclass(frozen=True, slots=True)
class TensorParallel:
    """Rank ``rank`` of ``size`` and, where ``size`` > 1, the process group its collectives
    run on (gloo on the CPU, NCCL on CUDA). The default, rank 0 of 1, is the unsharded
    model, whose collectives do nothing."""

    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None
    deterministic: bool = False
    # The rendezvous the group was made through; rank 0's serves the others, so it lives on.
    store: dist.Store | None = None
    # Experts held whole, a share per rank, instead of each split over the ranks.
    expert_parallel: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tensor parallel rank {self.rank} is not in [0, {self.size})")

    # -- what this rank holds --------------------------------------------------------------------

    def heads(self, num_heads: int) -> range:
        per_rank = num_heads // self.size
        return range(self.rank * per_rank, (self.rank + 1) * per_rank)

    def kv_heads(self, num_kv_heads: int) -> range:
        if num_kv_heads >= self.size:
            return self.heads(num_kv_heads)
        # Fewer KV heads than ranks: rank r's query heads all belong to KV head r * kv / size.
        head = self.rank * num_kv_heads // self.size
        return range(head, head + 1)

    def part(self, total: int) -> range:
        per_rank = total // self.size
        return range(self.rank * per_rank, (self.rank + 1) * per_rank)

    def experts(self, num_experts: int) -> range:
        """The experts this rank holds: all of them, each in part, or with expert parallelism
        its share of them whole."""
        return self.part(num_experts) if self.expert_parallel else range(num_experts)

    def expert_part(self, width: int) -> range:
        """This rank's slice of each expert's MLP width (all of it with expert parallelism)."""
        return range(width) if self.expert_parallel else self.part(width)

    def vocab_rows(self, vocab_size: int) -> range:
        """This rank's rows of the embedding and head, padded: ``ceil(vocab / size)`` of them,
        the ones past the vocabulary zero."""
        per_rank = ceil_div(vocab_size, self.size)
        return range(self.rank * per_rank, (self.rank + 1) * per_rank)

    # -- collectives -----------------------------------------------------------------------------

    def all_reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of ``partial`` (a row-parallel layer's output)."""
        if self.size == 1:
            return partial
        assert self.group is not None, "a sharded model needs its process group"
        if self.deterministic:
            parts = self._gather(partial)
            total = parts[0].clone()
            for part in parts[1:]:
                total += part
            return total
        partial = partial.contiguous()
        self.group.allreduce([partial]).wait()
        return partial

    def all_gather_columns(self, local: torch.Tensor) -> torch.Tensor:
        """``[M, cols]`` from every rank, side by side in rank order: ``[M, size * cols]``."""
        if self.size == 1:
            return local
        return torch.cat(self._gather(local), dim=-1)

    def agree_min(self, value: int, device: torch.device) -> int:
        """The smallest ``value`` any rank holds (every rank calls this together)."""
        if self.size == 1:
            return value
        assert self.group is not None, "a sharded model needs its process group"
        tensor = torch.tensor([value], dtype=torch.int64, device=device)
        options = dist.AllreduceOptions()
        # torch's stubs give ReduceOp's members a type of their own (RedOpType).
        options.reduceOp = dist.ReduceOp.MIN  # type: ignore[assignment]
        self.group.allreduce([tensor], options).wait()
        return int(tensor.item())

    def _gather(self, local: torch.Tensor) -> list[torch.Tensor]:
        assert self.group is not None, "a sharded model needs its process group"
        local = local.contiguous()
        parts = [torch.empty_like(local) for _ in range(self.size)]
        self.group.allgather([parts], [local]).wait()
        return parts


def check_shardable(config: ModelConfig, size: int, expert_parallel: bool = False) -> None:
    """Raise ``ValueError`` saying why ``config``'s model cannot be split ``size`` ways (its
    experts whole where ``expert_parallel``)."""
    if size < 1:
        raise ValueError(f"--tensor-parallel-size must be >= 1, got {size}")
    if expert_parallel and config.moe is None:
        raise ValueError(f"--enable-expert-parallel: {config.path} has no experts")
    if size == 1:
        return
    problems = []
    if config.num_heads % size:
        problems.append(f"its {config.num_heads} attention heads")
    kv = config.num_kv_heads
    if kv % size and size % kv:
        problems.append(f"its {kv} KV heads (nor does the size divide by them)")
    moe = config.moe
    dense_layers = config.num_layers if moe is None else config.num_layers - len(moe.sparse_layers)
    if dense_layers and config.intermediate_size % size:
        problems.append(f"its MLP width {config.intermediate_size}")
    if moe is not None and expert_parallel and moe.num_experts % size:
        problems.append(f"its {moe.num_experts} experts")
    if moe is not None and not expert_parallel and moe.expert_intermediate_size % size:
        problems.append(f"its experts' width {moe.expert_intermediate_size}")
    if moe is not None and moe.shared_expert_intermediate_size % size:
        problems.append(f"its shared expert's width {moe.shared_expert_intermediate_size}")
    if problems:
        raise ValueError(
            f"--tensor-parallel-size {size} does not divide {' or '.join(problems)} ({config.path})"
        )


def connect(
    rank: int,
    size: int,
    port: int,
    device: torch.device,
    deterministic: bool,
    expert_parallel: bool = False,
) -> TensorParallel:
    """Join the group of ``size`` ranks whose rank 0 hosts the rendezvous on loopback ``port``
    (every rank calls this; rank 0's call serves the others)."""
    store = dist.TCPStore("127.0.0.1", port, size, rank == 0, timeout=COLLECTIVE_TIMEOUT)
    # torch's stubs make each backend's group a class apart from ProcessGroup (and NCCL's
    # options a required argument), though both serve every collective the model calls.
    group: dist.ProcessGroup
    if device.type == "cuda":
        nccl = dist.ProcessGroupNCCL(dist.PrefixStore("tp", store), rank, size)  # type: ignore[call-arg]
        group = cast(dist.ProcessGroup, nccl)
    else:
        gloo = dist.ProcessGroupGloo(dist.PrefixStore("tp", store), rank, size, COLLECTIVE_TIMEOUT)
        group = cast(dist.ProcessGroup, gloo)
    return TensorParallel(rank, size, group, deterministic, store, expert_parallel)
