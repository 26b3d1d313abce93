"""The Hadamard turn that int8 KV pages are stored in.

A few key channels of most models carry outliers many times the size of the rest; one scale per
(token, head) vector then spends int8's 255 steps on them and rounds every other channel to a
handful of steps. Turning each head vector by an orthogonal Hadamard matrix ``H`` spreads every
channel over all of them, so the vector's amax comes close to its norm over sqrt(head_dim) and
int8 steps fit the whole vector (benchmarks/RESULTS.md, "Finished studies", has the measurement).

The turn changes nothing the model computes: queries and keys are turned alike after RoPE, so
``(q H)(k H)^T = q k^T``; values are turned before they are stored and the attention output is
turned back, ``(p V H) H^T = p V``. The attention kernels never know.

``H`` is the Sylvester matrix of ±1 entries (symmetric, ``H H = d I``). Instead of ``H / sqrt(d)``
on both sides, keys and values take ``H * a`` and queries and the output ``H * b`` with ``a * b =
1 / d``, both powers of two: every weight is exact in bf16 and the products are the model's own.
"""

from __future__ import annotations

import torch
from torch import nn


def sylvester_hadamard(n: int) -> torch.Tensor:
    """The ``n x n`` matrix of ±1 with orthogonal rows (``n`` a power of two), float32."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"a Hadamard turn needs a power-of-two head_dim, got {n}")
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return h


def turn_scales(head_dim: int) -> tuple[float, float]:
    """``(a, b)``: powers of two with ``a * b = 1 / head_dim``, as even as they can be."""
    log2 = head_dim.bit_length() - 1
    return 2.0 ** -(log2 // 2), 2.0 ** -(log2 - log2 // 2)


def hadamard_turns(
    head_dim: int, dtype: torch.dtype, device: torch.device | str
) -> tuple[nn.Linear, nn.Linear]:
    """``(query_turn, kv_turn)``: linear layers over one head vector. ``kv_turn`` turns keys and
    values; ``query_turn`` turns queries and turns the attention output back."""
    h = sylvester_hadamard(head_dim)
    kv_scale, query_scale = turn_scales(head_dim)
    turns = []
    for scale in (query_scale, kv_scale):
        linear = nn.Linear(head_dim, head_dim, bias=False, device=device, dtype=dtype)
        with torch.no_grad():
            linear.weight.copy_(h * scale)  # H is symmetric: x @ W^T == x @ W
        linear.weight.requires_grad_(False)
        turns.append(linear)
    return turns[0], turns[1]
