"""The state of one request inside an engine: its tokens, its pages, how far its KV is computed."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from common.engine.sampler import PromptLogprob, SampledToken
from common.engine.structured.state import GrammarState
from common.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # an end-of-sequence or stop token
    LENGTH = "length"  # max_tokens or the model's length limit
    ABORT = "abort"


@dataclass(slots=True)
class SpeculationState:
    """How speculation goes for one sequence (``common/engine/speculative``)."""

    acceptance: float = 1.0  # moving average of the chance a proposed token is accepted
    idle_steps: int = 0  # steps left without proposals, after acceptance collapsed
    collapses: int = 0  # collapses since the last accepted token
    draft_fed_tokens: int = 0  # leading positions a draft model has written its KV for


@dataclass(slots=True, eq=False)
class Sequence:
    request_id: str
    token_ids: list[int]  # prompt followed by every generated token
    num_prompt_tokens: int
    params: SamplingParams
    samples: list[SampledToken] = field(default_factory=list)  # one per generated token
    # One page per page_size positions, in order; the first num_released_pages were given back
    # to the pool (every position in them is behind every layer's sliding window): their ids
    # only keep the others in place, and belong to the sequence no more.
    page_ids: list[int] = field(default_factory=list)
    num_released_pages: int = 0
    page_hashes: list[int] = field(default_factory=list)  # chained hashes of full pages, in order
    # The prefix-cache namespace its pages are hashed under (common/hashing.py): "" for the base
    # model; sequences of different namespaces never share pages.
    cache_namespace: str = ""
    # The LoRA adapter it computes under (common/engine/lora.py); None: the base model.
    lora_name: str | None = None
    num_computed_tokens: int = 0  # leading tokens whose KV is in the pool
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at admission
    # Whether the KV tiers' misses for its prompt were counted: once a sequence, not at every
    # step it waits at the head of the queue.
    tier_misses_counted: bool = False
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    # time.monotonic() when the scheduler took it (again, after a handoff), and when it first
    # ran: the worker reports the wait and the prefill from them.
    queued_time: float | None = None
    first_scheduled_time: float | None = None
    # Decode, after a handoff: prefill finished -> every page here; reported with its first step.
    handoff_wait_s: float | None = None
    speculation: SpeculationState = field(default_factory=SpeculationState)
    # With params.prompt_logprobs: prompt tokens 1.. scored so far, in order.
    prompt_logprobs: list[PromptLogprob] = field(default_factory=list)
    # With params.structured: its grammar, which masks every token it samples (the scheduler
    # makes it on admission).
    grammar: GrammarState | None = None

    @classmethod
    def from_prompt(
        cls, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> Sequence:
        return cls(request_id, list(prompt_token_ids), len(prompt_token_ids), params)

    @property
    def held_page_ids(self) -> list[int]:
        """The pages the sequence holds: all but the released ones."""
        return self.page_ids[self.num_released_pages :]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_prompt_logprobs_due(self) -> int:
        """Prompt tokens still to be scored for ``params.prompt_logprobs`` (0 if not asked).
        They go out with the first output token, so once there is one none are due (a decode
        worker continuing a shipped prompt scores nothing: its prefill worker did)."""
        if self.params.prompt_logprobs is None or self.num_output_tokens:
            return 0
        return self.num_prompt_tokens - 1 - len(self.prompt_logprobs)


def first_output_prompt_logprobs(seq: Sequence, num_new: int) -> list[PromptLogprob] | None:
    """The prompt logprobs to report with ``seq``'s ``num_new`` newest tokens: all of them when
    those include the first output token and they were asked for, else None."""
    if seq.params.prompt_logprobs is None or seq.num_output_tokens != num_new:
        return None
    return seq.prompt_logprobs
