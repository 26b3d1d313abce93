"""The router's recent traffic, for the planner: each request's arrival with its prompt length
and token limit, and each finished sequence with its lengths and latencies.

Read-only from outside (``GET /v1/traffic``); fed by the dispatcher. Bounded: the latest
``MAX_ENTRIES`` of each kind, and only those younger than the window a reader asks for.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

MAX_ENTRIES = 8192
MAX_WINDOW_S = 600.0


@dataclass(frozen=True, slots=True)
class Arrival:
    at: float  # time.monotonic() of its arrival at the router
    prompt_tokens: int
    max_tokens: int


@dataclass(frozen=True, slots=True)
class Finished:
    at: float  # time.monotonic() of its end
    prompt_tokens: int
    output_tokens: int
    ttft_s: float
    tpot_s: float  # mean time per output token after the first (0 for one token)
    reason: str


class TrafficLog:
    def __init__(self, max_entries: int = MAX_ENTRIES) -> None:
        self.arrivals: deque[Arrival] = deque(maxlen=max_entries)
        self.finished: deque[Finished] = deque(maxlen=max_entries)

    def arrived(self, at: float, prompt_tokens: int, max_tokens: int) -> None:
        self.arrivals.append(Arrival(at, prompt_tokens, max_tokens))

    def ended(self, entry: Finished) -> None:
        self.finished.append(entry)

    def window(self, now: float, window_s: float) -> dict:
        """The ``GET /v1/traffic`` body: entries of the last ``window_s`` seconds (at most
        ``MAX_WINDOW_S``), each with its age in seconds."""
        if not 0 < window_s <= MAX_WINDOW_S:
            raise ValueError(f"window_s must be in (0, {MAX_WINDOW_S:g}], got {window_s}")
        since = now - window_s
        return {
            "window_s": window_s,
            "arrivals": [
                {"age_s": now - a.at, "prompt_tokens": a.prompt_tokens, "max_tokens": a.max_tokens}
                for a in self.arrivals
                if a.at >= since
            ],
            "finished": [
                {
                    "age_s": now - f.at,
                    "prompt_tokens": f.prompt_tokens,
                    "output_tokens": f.output_tokens,
                    "ttft_s": f.ttft_s,
                    "tpot_s": f.tpot_s,
                    "reason": f.reason,
                }
                for f in self.finished
                if f.at >= since
            ],
        }
