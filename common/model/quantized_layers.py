"""The embedding table of a quantized checkpoint (``kernels/quantized.py``), in torch, on any
device; its linear layers are ``kernels/quantized.py``'s ``QuantizedLinear``."""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from common.model.parallel import TensorParallel
from kernels.quantized import QuantizedWeight


class QuantizedEmbedding(nn.Module):
    """A token's row of a quantized table, dequantized to ``dtype`` as it is looked up (GGUF
    files quantize the embedding, which tied models share with the output projection).

    Under tensor parallelism the table holds this rank's rows of the vocabulary, as
    ``VocabParallelEmbedding``'s does: a token is looked up on the rank holding its row, zeros
    elsewhere, and the all-reduce puts every row in place on every rank."""

    def __init__(
        self, table: QuantizedWeight, dtype: torch.dtype, tp: TensorParallel, first_row: int = 0
    ) -> None:
        """``first_row``: the vocabulary row this rank's first row of ``table`` holds."""
        super().__init__()
        self.table = table
        self.dtype = dtype
        self.tp = tp
        self.first_row = first_row
        self.num_rows = table.out_features

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self._rows(input_ids)
        local = input_ids - self.first_row
        elsewhere = (local < 0) | (local >= self.num_rows)
        hidden = self._rows(local.masked_fill(elsewhere, 0))
        return self.tp.all_reduce(hidden.masked_fill(elsewhere[:, None], 0.0))

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        table = self.table
        offsets = None if table.offsets is None else table.offsets[ids]
        rows = replace(table, codes=table.codes[ids], scales=table.scales[ids], offsets=offsets)
        return rows.dequantize(self.dtype)
