"""Chooses the next token of every sequence in a batch from the model's logits.

The order of operations is vLLM's:

0. a row under a structured output keeps only the tokens its grammar allows (the runner's
   masks, ``common/engine/structured/``): the logprobs below see the grammar, as vLLM's do;
1. logprobs to report come from the raw logits (``log_softmax`` before anything below);
2. ``allowed_token_ids``: every token outside the list gets ``-inf``;
3. bad words: the token that would complete one at the end of the output gets ``-inf``;
4. ``min_tokens``: until a sequence has that many output tokens, its stop token ids, and EOS
   unless ``ignore_eos``, get ``-inf``;
5. ``logit_bias`` is added;
6. repetition, frequency and presence penalties;
7. greedy rows (``temperature == 0``) take the argmax;
8. the other rows are divided by their temperature, filtered by top-k, top-p and min-p, and
   sampled.

Sampling is an exponential race, ``argmax(p / E)`` with ``E ~ Exponential(1)`` drawn per token,
which picks token ``i`` with probability ``p[i]`` and is a pure function of the noise. A seeded
row draws its noise from a generator seeded with a hash of ``(seed, step)`` only, ``step`` being
the number of tokens it has generated, so any process sampling that step draws the same noise:
the prefill worker's first token and the decode worker's later ones are what one process would
have sampled, whatever else shares the batch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import NamedTuple, cast

import torch

from common.engine.structured.masks import GrammarMasks, apply_masks
from common.sampling_params import SamplingParams
from kernels.argmax import argmax_rows

_MASK64 = (1 << 64) - 1
# Top-p usually keeps a few dozen tokens, so on a CPU its threshold is looked for among each row's
# largest values, widening (64, then 1024, then the whole row) only for rows whose kept set
# reaches past them: a full sort of 256 rows of a 50k vocabulary takes over a second on a CPU. A
# GPU sorts whole rows in a fraction of a millisecond, and a search that widens would wait on the
# device to decide each next width: there the first width is the whole row.
_FIRST_CANDIDATES = 64
_WIDEN = 16
_MAX_CANDIDATES = 1024
_PROMPT_ROWS_PER_SLICE = 256


@dataclass(slots=True)
class SamplingRow:
    """What the sampler needs to know about one sequence: its params and its tokens before this
    row, which are ``token_ids`` (prompt, then output) followed by ``proposed`` (proposals that
    a verification step treats as already generated for this row).

    ``token_ids`` may be the sequence's own list, not a copy: the prompt and output views are
    sliced only for the rows that read them (penalties), so a step of plain rows copies no
    history. The sampler never modifies either."""

    params: SamplingParams
    token_ids: Sequence[int]
    num_prompt_tokens: int
    proposed: Sequence[int] = ()
    # Tokens sampled before this row whose ids are not on the host yet (a step launched ahead,
    # common/engine/llm_engine.py): they count as generated (a seeded row's step, min_tokens),
    # and such a row is never one that reads its history (``draws_from_logits_alone``).
    tokens_in_flight: int = 0

    @classmethod
    def of(
        cls, params: SamplingParams, prompt: Sequence[int], output: Sequence[int]
    ) -> SamplingRow:
        return cls(params, prompt, len(prompt), output)

    @property
    def prompt_token_ids(self) -> Sequence[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return [*self.token_ids[self.num_prompt_tokens :], *self.proposed]

    @property
    def num_output_tokens(self) -> int:
        return (
            len(self.token_ids)
            - self.num_prompt_tokens
            + len(self.proposed)
            + self.tokens_in_flight
        )


class SampledToken(NamedTuple):
    """One sampled token. A tuple, not a class instance: a decode worker keeps one per generated
    token for as long as its request runs, and a tuple of plain values is soon dropped from the
    cycle collector's books, which would otherwise walk every one of them again and again."""

    token_id: int
    # Both are set when params.logprobs is not None, and come from the raw logits.
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None  # (token_id, logprob), best first


@dataclass(slots=True)
class PromptLogprob:
    """A prompt token's logprob given the tokens before it (raw logits), its rank among the
    vocabulary (1: the most likely), and the most likely alternatives."""

    token_id: int
    logprob: float
    rank: int
    top_logprobs: list[tuple[int, float]]  # (token_id, logprob), best first


def prompt_logprobs(logits: torch.Tensor, targets: Sequence[int], k: int) -> list[PromptLogprob]:
    """Each row of ``logits [n, >= V]`` scored against the prompt token that followed it."""
    scored: list[PromptLogprob] = []
    # A float32 log_softmax of a whole chunk is rows x vocabulary x 4 bytes (1 GB for 2048 rows
    # of a 128k vocabulary): slices keep it small.
    for start in range(0, len(targets), _PROMPT_ROWS_PER_SLICE):
        end = min(start + _PROMPT_ROWS_PER_SLICE, len(targets))
        scored += _score_rows(logits[start:end], targets[start:end], k)
    return scored


def _score_rows(logits: torch.Tensor, targets: Sequence[int], k: int) -> list[PromptLogprob]:
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    target = torch.tensor(targets, device=logits.device)[:, None]
    chosen = logprobs.gather(1, target)
    ranks = (logprobs > chosen).sum(dim=-1).add_(1).tolist()
    top_values, top_ids = logprobs.topk(min(k, logprobs.shape[1]), dim=-1)
    return [
        PromptLogprob(token_id, logprob, rank, list(zip(ids, values, strict=True)))
        for token_id, logprob, rank, ids, values in zip(
            targets, chosen.squeeze(1).tolist(), ranks, top_ids.tolist(), top_values.tolist(),
            strict=True,
        )
    ]  # fmt: skip


class Sampler:
    """Samples one token for each row of a batch of logits.

    A worker calls ``sample`` once per forward with the logits of each sequence's last position.
    ``sample`` modifies neither the logits nor the rows. Every row's params must have passed
    ``check_token_ids(vocab_size)``, and every prompt and output token id must lie in
    ``[0, vocab_size)``.

    Seeded rows give the same tokens in any process on the same kind of device (CPU and CUDA
    generators draw different streams from one seed). Unseeded rows draw from one generator per
    sampler and device, seeded from the operating system's entropy.
    """

    def __init__(self, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        out_of_range = [t for t in eos_token_ids if not 0 <= t < vocab_size]
        if out_of_range:
            raise ValueError(f"eos_token_ids {out_of_range} are outside [0, {vocab_size})")
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._generators: dict[torch.device, torch.Generator] = {}

    def sample(
        self,
        logits: torch.Tensor,
        rows: Sequence[SamplingRow],
        masks: GrammarMasks | None = None,
    ) -> list[SampledToken]:
        """Sample one token per row of ``logits [B, V_model]`` (any float dtype; columns past
        ``vocab_size`` are padding and never sampled); ``masks``: the grammars' of the rows
        under a structured output."""
        if logits.dim() != 2 or logits.shape[0] != len(rows) or logits.shape[1] < self.vocab_size:
            raise ValueError(
                f"logits must be [len(rows), >= vocab_size] = [{len(rows)}, >= {self.vocab_size}],"
                f" got {list(logits.shape)}"
            )
        if not rows:
            return []
        if masks is None and all(plain_argmax(row.params, row.num_output_tokens) for row in rows):
            return self.argmax(logits)
        params = [row.params for row in rows]
        want_logprobs = [i for i, p in enumerate(params) if p.logprobs is not None]
        token_ids, raw_logprobs = self._draw(logits, rows, want_logprobs, masks)
        results = plain_samples(token_ids.tolist())
        if raw_logprobs is not None:
            _fill_logprobs(results, params, want_logprobs, raw_logprobs, token_ids)
        return results

    def sample_ids(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """``sample``'s token ids [len(rows)], int64, left on the logits' device: what a step
        launched without waiting for its tokens samples (``ModelRunner.launch_decodes``). Every
        row ``draws_from_logits_alone``; the host reads nothing of the device here, and what it
        sends there goes through pinned memory, so nothing waits for the device's queue."""
        if all(plain_argmax(row.params, row.num_output_tokens) for row in rows):
            return self.argmax_ids(logits)
        return self._draw(logits, rows, [])[0]

    def _draw(
        self,
        logits: torch.Tensor,
        rows: Sequence[SamplingRow],
        want_logprobs: list[int],
        masks: GrammarMasks | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Steps 0 to 8 of the module's docstring: the token ids [len(rows)] on the device, and
        the raw logprobs of the rows ``want_logprobs`` (None if none)."""
        x = logits[:, : self.vocab_size]
        # The steps below edit x in place: a float32 copy of the real vocabulary where any row
        # is edited, else (greedy rows with nothing to mask, ban, bias or penalise) the
        # float32 logits themselves, only read.
        if x.dtype != torch.float32 or masks is not None or any(_edits_logits(r) for r in rows):
            x = x.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
        if masks is not None:
            apply_masks(x, masks)
        params = [row.params for row in rows]
        raw_logprobs = None
        if want_logprobs:
            raw_logprobs = torch.log_softmax(_select(x, want_logprobs), dim=-1)

        _keep_allowed_tokens(x, params)
        # Bad words and min_tokens' stop tokens are both bans: one fill of -inf for the two.
        width = x.shape[1]
        _ban(x, _bad_word_completions(rows, width) + self._stop_tokens_held_off(rows, width))
        _add_logit_bias(x, params)
        apply_penalties(x, rows)

        greedy = [i for i, p in enumerate(params) if p.is_greedy]
        rest = [i for i, p in enumerate(params) if not p.is_greedy]
        if not rest:  # the usual decode step: no index tensor, no scatter, no copy
            return argmax_rows(x), raw_logprobs
        if not greedy:  # every row samples: none either
            return self._sample_random(x, rows), raw_logprobs
        token_ids = torch.empty(len(rows), dtype=torch.long, device=x.device)
        greedy_ids = argmax_rows(_select(x, greedy))
        # x is not read after this, so the sampler may edit it in place.
        random_ids = self._sample_random(_select(x, rest), [rows[i] for i in rest])
        token_ids.index_copy_(0, on_device(greedy, torch.long, x.device), greedy_ids)
        token_ids.index_copy_(0, on_device(rest, torch.long, x.device), random_ids)
        return token_ids, raw_logprobs

    def argmax(self, logits: torch.Tensor) -> list[SampledToken]:
        """Each row's argmax over the vocabulary, as ``sample`` gives it for rows whose params
        are ``plain_argmax``: the usual decode step, one pass over the logits and no other
        work."""
        return plain_samples(self.argmax_ids(logits).tolist())

    def argmax_ids(self, logits: torch.Tensor) -> torch.Tensor:
        """``argmax``'s token ids [rows], int64, left on the logits' device. Logits in another
        dtype than float32 are read as ``sample`` reads them."""
        x = logits[:, : self.vocab_size]
        if x.dtype != torch.float32:
            x = x.float()
        return argmax_rows(x)

    def _stop_tokens_held_off(self, rows: Sequence[SamplingRow], width: int) -> list[int]:
        """The flat positions (row * ``width`` + token) of the stop token ids, and EOS unless
        ``ignore_eos``, of the rows short of their ``min_tokens``."""
        flat: list[int] = []
        for i, row in enumerate(rows):
            p = row.params
            if row.num_output_tokens < p.min_tokens:
                # With ignore_eos the scheduler does not stop on EOS, so it may be sampled.
                banned = p.stop_token_ids if p.ignore_eos else p.stop_token_ids + self.eos_token_ids
                flat += [i * width + token for token in banned]
        return flat

    def _sample_random(self, x: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """Token ids [n] for rows of penalised logits ``x [n, V]`` (owned: edited in place)."""
        params = [row.params for row in rows]
        temperature = on_device([p.temperature for p in params], torch.float32, x.device)
        # Shifting each row's max to 0 first keeps a small temperature from overflowing to inf,
        # and makes p[i] / p_max = exp(x[i]) for min-p.
        x.sub_(x.amax(dim=-1, keepdim=True)).div_(temperature[:, None])
        threshold = _filter_threshold(x, params)
        if threshold is not None:
            x.masked_fill_(x < threshold[:, None], -math.inf)
        # Unnormalised probabilities are enough: scaling a row does not move its argmax.
        probs = x.exp_()
        # E = -log(U) with U uniform in [0, 1) is Exponential(1) and strictly positive (inf at
        # U = 0), so p / E is never 0 / 0 and a filtered-out token can never win.
        noise = self._uniform(rows, x.shape[1], x.device).log_().neg_()
        return argmax_rows(probs.div_(noise))

    def _uniform(
        self, rows: Sequence[SamplingRow], width: int, device: torch.device
    ) -> torch.Tensor:
        """Uniform [0, 1) noise [len(rows), width]: a seeded row's drawn from a generator of its
        own, so that it depends on nothing but the row's (seed, step); the others' from the
        sampler's generator, in one draw (a launch per row would cost a GPU's host more than
        the draw)."""
        u = torch.empty(len(rows), width, device=device)
        seeded = [i for i, row in enumerate(rows) if row.params.seed is not None]
        if len(seeded) < len(rows):
            u.uniform_(generator=self._generator(device))
        for i in seeded:
            seed = rows[i].params.seed
            assert seed is not None
            generator = torch.Generator(device=device)
            generator.manual_seed(_step_seed(seed, rows[i].num_output_tokens))
            u[i].uniform_(generator=generator)
        return u

    def _generator(self, device: torch.device) -> torch.Generator:
        generator = self._generators.get(device)
        if generator is None:
            generator = torch.Generator(device=device)
            generator.seed()
            self._generators[device] = generator
        return generator


def plain_samples(token_ids: list[int]) -> list[SampledToken]:
    """A ``SampledToken`` with no logprobs for each id, made by the tuple type's own constructor
    in C: the named tuple's is a Python function, and takes twice as long (64 ids: 13 against
    7 us)."""
    rows = zip(token_ids, repeat(None), repeat(None))
    return cast(list[SampledToken], list(map(tuple.__new__, repeat(SampledToken), rows)))


def _keep_allowed_tokens(x: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    """``-inf`` for every token outside a row's ``allowed_token_ids``: a row of ``-inf`` with
    zeros at the allowed places, added to the row's logits. Only the allowed ids travel to the
    device, not a mask of the vocabulary."""
    rows = [i for i, p in enumerate(params) if p.allowed_token_ids is not None]
    if not rows:
        return
    width = x.shape[1]
    flat = [
        slot * width + token
        for slot, i in enumerate(rows)
        for token in cast("list[int]", params[i].allowed_token_ids)
    ]
    kept = torch.full((len(rows), width), -math.inf, device=x.device)
    kept.view(-1).index_fill_(0, on_device(flat, torch.long, x.device), 0.0)
    x.index_add_(0, on_device(rows, torch.long, x.device), kept)


def _ban(x: torch.Tensor, flat: list[int]) -> None:
    """``-inf`` at the flat positions row * V + token of ``x``, the sampler's own contiguous
    copy here (a ban edits the logits): the -inf goes as a plain number, only the positions are
    sent."""
    if flat:
        x.view(-1).index_fill_(0, on_device(flat, torch.long, x.device), -math.inf)


def _bad_word_completions(rows: Sequence[SamplingRow], width: int) -> list[int]:
    """The flat positions (row * ``width`` + token) of each token that would complete one of a
    row's bad words: a one-token word's always, a longer word's last token where the output
    (proposals under verification included, the prompt not, as in vLLM) ends with the rest of
    the word."""
    flat: list[int] = []
    for i, row in enumerate(rows):
        words = row.params.bad_words_token_ids
        if not words:
            continue
        # The output's last tokens a word's prefix can span, the rest of it not copied.
        need = max(len(word) for word in words) - 1
        start = max(row.num_prompt_tokens, len(row.token_ids) - need)
        tail = [*row.token_ids[start:], *row.proposed][-need:] if need else []
        for word in words:
            before = len(word) - 1
            if before == 0 or (before <= len(tail) and tail[len(tail) - before :] == word[:-1]):
                flat.append(i * width + word[-1])
    return flat


def _add_logit_bias(x: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    row_index: list[int] = []
    token_index: list[int] = []
    bias: list[float] = []
    for i, p in enumerate(params):
        if p.logit_bias:
            row_index += [i] * len(p.logit_bias)
            token_index += p.logit_bias.keys()
            bias += p.logit_bias.values()
    if row_index:
        # Each row's bias names a token once, so adding them at their places accumulates none.
        index = (
            on_device(row_index, torch.long, x.device),
            on_device(token_index, torch.long, x.device),
        )
        x.index_put_(index, on_device(bias, torch.float32, x.device), accumulate=True)


def apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """Apply each row's repetition, frequency and presence penalties to ``logits [B, V]`` in place.

    Repetition (HF/vLLM): a token seen in the prompt or the output has its logit divided by the
    penalty when positive, multiplied by it otherwise. Frequency and presence count the output
    only: ``logit -= frequency * count + presence * (count > 0)``.
    """
    penalised = [i for i, row in enumerate(rows) if _has_penalties(row.params)]
    if not penalised:
        return
    vocab_size, device = logits.shape[1], logits.device
    # Only the logits of tokens a row has seen change: a few thousand per row, not the whole
    # vocabulary, so the work is done on their flat positions (row * V + token) rather than on
    # dense [B, V] count tensors.
    repeated = [i for i in penalised if rows[i].params.repetition_penalty != 1]
    if repeated:
        history = [rows[i].prompt_token_ids for i in repeated]
        history += [rows[i].output_token_ids for i in repeated]
        seen = torch.unique(_positions(history, repeated * 2, vocab_size).to(device))
        row_index, token_index = seen // vocab_size, seen % vocab_size
        r = _per_row(rows, "repetition_penalty", device)[row_index]
        values = logits[row_index, token_index]
        logits[row_index, token_index] = torch.where(values > 0, values / r, values * r)

    counted = [
        i
        for i in penalised
        if rows[i].params.frequency_penalty != 0 or rows[i].params.presence_penalty != 0
    ]
    if counted:
        output = _positions([rows[i].output_token_ids for i in counted], counted, vocab_size)
        positions, counts = torch.unique(output.to(device), return_counts=True)
        row_index, token_index = positions // vocab_size, positions % vocab_size
        frequency = _per_row(rows, "frequency_penalty", device)[row_index]
        presence = _per_row(rows, "presence_penalty", device)[row_index]
        logits[row_index, token_index] -= frequency * counts + presence


def _positions(
    sequences: Sequence[Sequence[int]], row_ids: Sequence[int], vocab_size: int
) -> torch.Tensor:
    """The flat positions ``row * vocab_size + token`` of every token of every sequence."""
    tokens = [torch.as_tensor(s, dtype=torch.long) for s in sequences]
    flat = torch.cat(tokens)
    # An id past the vocabulary would silently land in the next row's logits.
    if flat.numel() and not 0 <= int(flat.min()) <= int(flat.max()) < vocab_size:
        raise ValueError(f"token ids must lie in [0, {vocab_size}) to be penalised")
    lengths = torch.tensor([len(t) for t in tokens])
    return torch.repeat_interleave(torch.tensor(row_ids), lengths) * vocab_size + flat


def _per_row(rows: Sequence[SamplingRow], name: str, device: torch.device) -> torch.Tensor:
    """One sampling parameter of every row, as a float32 tensor [B]."""
    return torch.tensor([getattr(row.params, name) for row in rows], device=device)


def _select(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``x[rows]`` for increasing ``rows``; x itself, not a copy, when that is every row (the
    usual case, and a 50 MB copy saved at 256 x 49152)."""
    if len(rows) == x.shape[0]:
        return x
    return x.index_select(0, on_device(rows, torch.long, x.device))


def on_device(values: Sequence[float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A short host list as a tensor on ``device``, sent without waiting for the device
    (``sent``)."""
    return sent(torch.tensor(values, dtype=dtype), device)


def sent(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on ``device``, sent without waiting for the device: on CUDA through
    pinned memory, non-blocking. (A copy from pageable memory, which ``.to(device)``, indexing
    a device tensor with a Python list or ``torch.tensor(..., device=)`` makes, waits for the
    stream: for everything launched before it, a step launched ahead included.)"""
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def _edits_logits(row: SamplingRow) -> bool:
    """Whether sampling ``row`` edits its logits: a random pick (its noise race works in
    place), a whitelist, bad words, stop tokens banned until min_tokens, a logit bias or a
    penalty."""
    return not row.params.is_greedy or _edits_beyond_sampling(row.params, row.num_output_tokens)


def _edits_beyond_sampling(params: SamplingParams, num_output_tokens: int) -> bool:
    """A whitelist of tokens, a grammar, bad words, stop tokens banned until min_tokens, a logit
    bias or a penalty."""
    return (
        params.allowed_token_ids is not None
        or params.structured is not None
        or bool(params.bad_words_token_ids)
        or num_output_tokens < params.min_tokens
        or bool(params.logit_bias)
        or _has_penalties(params)
    )


def draws_from_logits_alone(params: SamplingParams, num_output_tokens: int) -> bool:
    """Whether the next token of a sequence with ``params`` and ``num_output_tokens`` output
    tokens so far is drawn from its logits with nothing read of its history and nothing to
    report: no penalty, no bad word (they read the output), no stop token banned
    (min_tokens), no grammar (its mask follows the output), no logprobs. Greedy or not, seeded
    or not, biased or filtered:
    ``sample_ids`` draws it on the device. Like ``plain_argmax``, once true it stays so as the
    output grows."""
    return (
        params.logprobs is None
        and params.structured is None  # its mask waits for the token before it
        and not _has_penalties(params)
        and not params.bad_words_token_ids
        and num_output_tokens >= params.min_tokens
    )


def plain_argmax(params: SamplingParams, num_output_tokens: int) -> bool:
    """Whether the next token of a sequence with ``params`` and ``num_output_tokens`` output
    tokens so far is its logits' argmax and nothing else is asked of it: greedy, with nothing to
    report, whitelist, ban (bad words, min_tokens), bias or penalise."""
    return (
        params.is_greedy
        and params.logprobs is None
        and not _edits_beyond_sampling(params, num_output_tokens)
    )


def _has_penalties(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1 or p.frequency_penalty != 0 or p.presence_penalty != 0


def _filter_threshold(x: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor | None:
    """The lowest logit each row keeps under its top-k, top-p and min-p: [n], or None when no row
    filters. ``x [n, V]`` holds temperature-scaled logits whose row max is 0."""
    n, vocab_size = x.shape
    sorted_rows = [
        i
        for i, p in enumerate(params)
        if (p.top_k is not None and p.top_k < vocab_size) or p.top_p < 1
    ]
    min_p_rows = [i for i, p in enumerate(params) if p.min_p > 0]
    if not sorted_rows and not min_p_rows:
        return None
    threshold = x.new_full((n,), -math.inf)
    if sorted_rows:
        chosen = [params[i] for i in sorted_rows]
        top_k = torch.tensor([min(p.top_k or vocab_size, vocab_size) for p in chosen])
        # top_p = 1 becomes inf so rounding in the running sums can never drop a tail token.
        top_p = torch.tensor([p.top_p if p.top_p < 1 else math.inf for p in chosen])
        first_width = vocab_size if x.device.type == "cuda" else _FIRST_CANDIDATES
        found = _top_k_top_p_threshold(_select(x, sorted_rows), top_k, top_p, first_width)
        if len(sorted_rows) == n:  # the usual case: no index into the device's tensor
            threshold = found
        else:
            threshold.index_copy_(0, on_device(sorted_rows, torch.long, x.device), found)
    if min_p_rows:
        # With the row max at 0, p[i] < min_p * p_max exactly when x[i] < log(min_p).
        log_min_p = on_device([math.log(params[i].min_p) for i in min_p_rows], torch.float32,
                              x.device)  # fmt: skip
        at = on_device(min_p_rows, torch.long, x.device)
        threshold.index_copy_(0, at, torch.maximum(threshold.index_select(0, at), log_min_p))
    return threshold


def _top_k_top_p_threshold(
    x: torch.Tensor,  # [n, V] float32, row max 0
    top_k: torch.Tensor,  # [n] int64 in [1, V]; V means off (on the host: read there)
    top_p: torch.Tensor,  # [n] float32 in (0, 1), or inf for off; on the host
    first_width: int = _FIRST_CANDIDATES,
) -> torch.Tensor:
    """The lowest logit each row keeps under top-k and then top-p over the renormalised top-k,
    searched first among each row's ``first_width`` largest values (and more where needed).

    Top-p keeps the smallest set of most likely tokens whose mass reaches ``top_p``: a token is
    kept while the mass before it is still short of ``top_p``. Values tied with the lowest kept
    one are kept too, so the result depends only on the values, never on how a sort breaks ties.
    """
    n, vocab_size = x.shape
    threshold = x.new_empty(n)
    # Top-p without top-k measures mass against the whole row; under top-k the k largest values,
    # all among the candidates, are the whole (renormalised) distribution.
    host_k = top_k.cpu()  # what decides the search's widths is read where it costs no wait
    full_mass = x.exp().sum(dim=-1) if bool((host_k == vocab_size).any()) else None
    largest_k = int(host_k.masked_fill(host_k == vocab_size, 0).max())
    width = min(vocab_size, max(first_width, largest_k))
    top_k, top_p = sent(top_k, x.device), sent(top_p, x.device)
    todo = torch.arange(n, device=x.device)
    while True:
        k, p = top_k[todo], top_p[todo]
        candidates = x if todo.numel() == n else x[todo]
        values = candidates.topk(width, dim=-1).values  # descending
        position = torch.arange(width, device=x.device)
        values = values.masked_fill(position >= k[:, None], -math.inf)
        weights = values.exp()  # unnormalised probabilities
        mass = weights.cumsum(dim=-1)
        total = mass[:, -1]
        if full_mass is not None:
            total = torch.where(k < vocab_size, total, full_mass[todo])
        keep = (values > -math.inf) & (mass - weights < p[:, None] * total[:, None])
        if width == vocab_size and todo.numel() == n:  # whole rows at once: every row settles
            return values.masked_fill(~keep, math.inf).amin(dim=-1)
        # A row is settled once its candidates hold the whole kept set.
        done = (k < vocab_size) | (mass[:, -1] >= p * total) | (width == vocab_size)
        threshold[todo[done]] = values[done].masked_fill(~keep[done], math.inf).amin(dim=-1)
        todo = todo[~done]
        if todo.numel() == 0:
            return threshold
        width = vocab_size if width >= _MAX_CANDIDATES else min(vocab_size, width * _WIDEN)


def _fill_logprobs(
    results: list[SampledToken],
    params: Sequence[SamplingParams],
    rows: list[int],
    raw_logprobs: torch.Tensor,  # [len(rows), V] log_softmax of the raw logits
    token_ids: torch.Tensor,  # [B] int64, the sampled tokens
) -> None:
    chosen = raw_logprobs.gather(1, token_ids[rows][:, None]).squeeze(1).tolist()
    most = min(max(params[i].logprobs or 0 for i in rows), raw_logprobs.shape[1])
    top = raw_logprobs.topk(most, dim=-1)  # sorted, best first
    top_values, top_ids = top.values.tolist(), top.indices.tolist()
    for j, i in enumerate(rows):
        k = params[i].logprobs or 0
        top_k = list(zip(top_ids[j][:k], top_values[j][:k], strict=True))
        results[i] = results[i]._replace(logprob=chosen[j], top_logprobs=top_k)


def _step_seed(seed: int, step: int) -> int:
    """The generator seed for a seeded request's ``step``-th output token.

    Two rounds of splitmix64 spread nearby seeds and steps over the whole 64-bit range. A CPU
    generator keeps only the low 32 bits, which splitmix64 mixes as well as the high ones.
    """
    return _splitmix64(_splitmix64(seed & _MASK64) ^ step)


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)
