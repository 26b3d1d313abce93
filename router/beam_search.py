"""Beam search over one prompt, as vLLM's API server does it: no model here, only the books.

vLLM runs beam search in its API server (``beam_search`` in vllm/entrypoints/generate/
beam_search/online.py) as repeated one-token generations, and pdserve's router does the same:
each step asks the workers for one token of every live beam with its ``2 * width`` most likely
continuations (``step_params``), and ``advance`` turns the answers into the next beams:

- every continuation of every beam is a candidate, scored by the beam's cumulative logprob plus
  its own (the raw logprobs: temperature and the other sampling knobs play no part);
- a candidate that is an EOS token (unless ``ignore_eos``) or a stop token id ends a beam: it is
  set aside as finished, without the ending token, and takes no live slot;
- of the others, the ``width`` best stay live; one whose text now holds a stop string is set
  aside as finished instead (its text cut before the stop string), and the next one takes its
  slot (vLLM ignores stop strings and stop token ids here; pdserve honours them);
- after ``max_tokens`` steps (or once no beam is live) the finished and live beams are sorted by
  ``cumulative logprob / length ** length_penalty``, where the length counts the prompt and
  the generated tokens (vLLM's ``get_beam_search_score``), and the ``width`` best are the
  answer, best first.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from common.protocol import TokenSample
from common.sampling_params import MAX_LOGPROBS, SamplingParams

# Each step asks for 2 * width logprobs per beam, and a worker gives at most MAX_LOGPROBS.
MAX_BEAM_WIDTH = MAX_LOGPROBS // 2


@dataclass(frozen=True, slots=True)
class BeamSearchParams:
    width: int
    max_tokens: int
    length_penalty: float = 1.0
    eos_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    stop_token_ids: frozenset[int] = frozenset()
    stop: tuple[str, ...] = ()
    include_stop_str: bool = False  # a stop string ends the text instead of being cut from it
    logprobs: int | None = None  # alternatives to report per token; None: none

    def step_params(self) -> SamplingParams:
        """One step of one beam: a single token, with enough logprobs for the candidates and
        for what the client asked to see."""
        return SamplingParams(
            max_tokens=1,
            temperature=0.0,
            logprobs=max(2 * self.width, self.logprobs or 0),
            ignore_eos=True,
        )


@dataclass(slots=True)
class Beam:
    tokens: list[int]  # generated so far (an ending EOS or stop token not among them)
    samples: list[TokenSample]  # per token: its logprob and the reported alternatives
    cum_logprob: float = 0.0
    finish_reason: str | None = None  # "stop" or "length"; None while live
    stop_reason: int | str | None = None  # the ending token id or stop string
    text: str | None = None  # set where a stop string cut it


@dataclass(slots=True)
class _Candidate:
    logprob: float  # cumulative
    token_logprob: float
    parent: Beam
    token_id: int
    sample: TokenSample


@dataclass(slots=True)
class BeamSearch:
    """The beams of one prompt. Per step: ``pending()`` names the token lists to extend,
    ``advance`` takes each one's ``TokenSample`` (asked with ``step_params``) in that order."""

    prompt: list[int]
    params: BeamSearchParams
    # The text of generated tokens, for stop strings (only called when there are some).
    decode: Callable[[list[int]], str]
    live: list[Beam] = field(default_factory=list)
    finished: list[Beam] = field(default_factory=list)
    steps: int = 0

    def __post_init__(self) -> None:
        self.live = [Beam(tokens=[], samples=[])]

    @property
    def done(self) -> bool:
        return not self.live or self.steps >= self.params.max_tokens

    def pending(self) -> list[list[int]]:
        return [self.prompt + beam.tokens for beam in self.live]

    def advance(self, samples: list[TokenSample]) -> None:
        if len(samples) != len(self.live):
            raise ValueError(f"{len(samples)} answers for {len(self.live)} beams")
        params = self.params
        ending = params.stop_token_ids
        if not params.ignore_eos:
            ending = ending | params.eos_token_ids
        continuing: list[_Candidate] = []
        for beam, sample in zip(self.live, samples, strict=True):
            for token_id, logprob in _continuations(sample, 2 * params.width):
                candidate = _Candidate(beam.cum_logprob + logprob, logprob, beam, token_id, sample)
                if token_id in ending:
                    self.finished.append(self._ended(candidate, "stop", token_id, add=False))
                else:
                    continuing.append(candidate)
        # Stable: among equal scores the earlier beam and the more likely token go first.
        continuing.sort(key=lambda c: -c.logprob)
        self.live = []
        for candidate in continuing:
            if len(self.live) == params.width:
                break
            beam = self._ended(candidate, None, None, add=True)
            cut = self._stop_string(beam) if params.stop else None
            if cut is None:
                self.live.append(beam)
            else:
                beam.finish_reason, beam.stop_reason, beam.text = "stop", cut[0], cut[1]
                self.finished.append(beam)
        self.steps += 1

    def best(self) -> list[Beam]:
        """The answer, once ``done``: the ``width`` best beams, best first; live ones end on
        their length."""
        for beam in self.live:
            beam.finish_reason = "length"
        prompt_len = len(self.prompt)
        penalty = self.params.length_penalty

        def score(beam: Beam) -> float:
            return beam.cum_logprob / (max(prompt_len + len(beam.tokens), 1) ** penalty)

        ranked = sorted(self.finished + self.live, key=score, reverse=True)
        return ranked[: self.params.width]

    def _ended(
        self, candidate: _Candidate, reason: str | None, stop: int | None, add: bool
    ) -> Beam:
        """The candidate's beam: its token added (``add``) or left out (an ending token, whose
        logprob still counts)."""
        parent, k = candidate.parent, self.params.logprobs
        tokens, samples = parent.tokens, parent.samples
        if add:
            sample = candidate.sample
            reported = TokenSample(
                candidate.token_id,
                candidate.token_logprob,
                None if k is None else (sample.top_token_ids or [])[:k],
                None if k is None else (sample.top_logprobs or [])[:k],
            )
            tokens, samples = [*tokens, candidate.token_id], [*samples, reported]
        return Beam(tokens, samples, candidate.logprob, reason, stop)

    def _stop_string(self, beam: Beam) -> tuple[str, str] | None:
        """(the stop string, the beam's text up to it, or through it with
        ``include_stop_str``) where the beam's text now holds one."""
        text = self.decode(beam.tokens)
        found = [(text.find(s), s) for s in self.params.stop]
        hits = [(at, s) for at, s in found if at >= 0]
        if not hits:
            return None
        at, stop = min(hits)
        return stop, text[: at + (len(stop) if self.params.include_stop_str else 0)]


def _continuations(sample: TokenSample, count: int) -> list[tuple[int, float]]:
    """A beam's candidates: its ``count`` most likely next tokens and the sampled one."""
    ids = (sample.top_token_ids or [])[:count]
    lps = (sample.top_logprobs or [])[:count]
    out = list(zip(ids, lps, strict=True))
    if sample.token_id not in ids and sample.logprob is not None:
        out.append((sample.token_id, sample.logprob))
    return out
