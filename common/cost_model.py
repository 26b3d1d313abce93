"""A simulated engine's step cost: what a step of so many tokens and rows takes on the device it
models (``common/engine/simulated.py``), and the prior the planner's fit starts from
(``planner/fit.py``). Torch-free, so the planner reads it too."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from pathlib import Path


@dataclass(frozen=True, slots=True)
class CostModel:
    """What one step costs on the modelled device, in seconds, and the pool it models."""

    fixed_s: float  # per step, whatever it holds (launches, host work)
    per_token_s: float  # per new token computed (the GEMMs' rows)
    per_seq_s: float = 0.0  # per row of the batch (sampling, per-sequence bookkeeping)
    per_context_token_s: float = 0.0  # per token of context attended (reading the KV)
    kv_tokens: int = 65536  # tokens the modelled device's KV pool holds
    max_num_batched_tokens: int | None = None  # the modelled engine's token budget per step
    source: str = ""  # where the figures come from, in words

    def __post_init__(self) -> None:
        for name in ("fixed_s", "per_token_s", "per_seq_s", "per_context_token_s"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
                raise ValueError(f"cost model: {name} must be a finite number >= 0, got {value!r}")
        if self.kv_tokens < 1:
            raise ValueError(f"cost model: kv_tokens must be >= 1, got {self.kv_tokens}")
        budget = self.max_num_batched_tokens
        if budget is not None and budget < 1:
            raise ValueError(f"cost model: max_num_batched_tokens must be >= 1, got {budget}")

    def step_seconds(self, new_tokens: int, rows: int, context_tokens: int) -> float:
        return (
            self.fixed_s
            + self.per_token_s * new_tokens
            + self.per_seq_s * rows
            + self.per_context_token_s * context_tokens
        )

    @classmethod
    def load(cls, path: str | Path) -> CostModel:
        """Read a cost model's JSON (``ValueError`` naming what is wrong with it)."""
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"cannot read the cost model {path}: {exc}") from exc
        if not isinstance(data, dict):
            raise ValueError(f"the cost model {path} is not a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known - {"comment", "measured"})
        if unknown:
            raise ValueError(f"the cost model {path} has unknown fields {unknown}")
        try:
            return cls(**{k: v for k, v in data.items() if k in known})
        except TypeError as exc:
            raise ValueError(f"the cost model {path}: {exc}") from exc

    def to_json(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}
