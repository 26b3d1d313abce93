"""Speculative decoding in the one-process engine: n-gram and draft proposers, verified in the
continuous batch. Speculation may change how many tokens a step yields, never which tokens."""

from __future__ import annotations

import json
import math

import pytest
import torch
from engines import build_engine
from tiny_models import build_tiny_model, random_prompts
from transformers import AutoModelForCausalLM

from common import metrics
from common.config import SpeculativeConfig
from common.engine.sequence import Sequence
from common.engine.speculative.ngram import NgramProposer
from common.engine.speculative.speculator import Speculator, StepCosts
from common.model.default_model import ensure_default_model
from common.sampling_params import SamplingParams
from common.tokenizer import Tokenizer

GREEDY = SamplingParams(max_tokens=40, temperature=0.0)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return build_tiny_model("llama3-rope", tmp_path_factory.mktemp("target"))


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory):
    """A draft of another shape and other weights: it proposes, the target mostly disagrees."""
    return build_tiny_model("qwen3-qknorm", tmp_path_factory.mktemp("draft"), seed=1)


@pytest.fixture
def weight_bound_step_costs(monkeypatch):
    """Step costs as a weight-bound step has them (a fixed read of the weights, a little per
    row) instead of the clock's. How much a step speculates follows what its rows cost, and on
    a loaded machine the clock can make a few more rows look dear and pause proposals for a
    whole run; tests that count proposed or accepted tokens use this, so their counts do not
    hang on the machine's load."""
    observe = StepCosts.observe
    monkeypatch.setattr(
        StepCosts, "observe", lambda self, rows, seconds: observe(self, rows, 0.02 + 1e-4 * rows)
    )


def repetitive_prompts(count: int = 8, seed: int = 3) -> list[list[int]]:
    """Random prompts said twice: n-gram lookup finds plenty to propose."""
    return [p + p for p in random_prompts(count, seed=seed)]


class Counted:
    """Proposed and accepted tokens counted while the block runs."""

    def __enter__(self):
        self._start = (metrics.SPEC_PROPOSED._value.get(), metrics.SPEC_ACCEPTED._value.get())
        return self

    def __exit__(self, *exc):
        self.proposed = metrics.SPEC_PROPOSED._value.get() - self._start[0]
        self.accepted = metrics.SPEC_ACCEPTED._value.get() - self._start[1]


def ngram(k: int = 4, **extra) -> SpeculativeConfig:
    return SpeculativeConfig(method="ngram", num_speculative_tokens=k, **extra)


def draft(folder, k: int = 4) -> SpeculativeConfig:
    return SpeculativeConfig(method="draft", model=str(folder), num_speculative_tokens=k)


# -- the n-gram proposer --------------------------------------------------------------------------


def test_ngram_lookup_takes_the_longest_suffix_and_its_latest_occurrence():
    proposer = NgramProposer(ngram_min=1, ngram_max=3)
    #        0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 8, 1, 6, 7, 9, 2, 6, 7]
    # The suffix 3-gram [2, 6, 7]... is new; [6, 7] last occurred at 5, followed by 9, 2, 6.
    assert proposer.lookup(tokens, 3) == [9, 2, 6]
    assert proposer.lookup(tokens, 1) == [9]
    assert proposer.lookup([1, 2, 3, 4], 2) == []  # nothing repeats
    # Too short for the minimum n-gram: no proposal.
    assert NgramProposer(ngram_min=2, ngram_max=4).lookup([3, 3], 2) == []
    # A match that runs into the end proposes what there is.
    assert proposer.lookup([4, 4, 4], 5) == [4]


# -- greedy exactness ----------------------------------------------------------------------------


@pytest.mark.usefixtures("weight_bound_step_costs")
@pytest.mark.parametrize(
    "dtype, kv",
    [("float32", "auto"), ("bfloat16", "auto"), ("float32", "fp8"), ("bfloat16", "int8")],
)
def test_ngram_speculation_gives_the_same_greedy_tokens(target, dtype, kv):
    prompts = repetitive_prompts()
    expected = build_engine(target, dtype=dtype, kv_cache_dtype=kv).generate(prompts, GREEDY)
    speculating = build_engine(target, speculative=ngram(), dtype=dtype, kv_cache_dtype=kv)
    with Counted() as counted:
        assert speculating.generate(prompts, GREEDY) == expected
    # Rejected runs are checked in test_sampled_distribution_is_the_targets.
    assert 0 < counted.accepted <= counted.proposed


@pytest.mark.usefixtures("weight_bound_step_costs")
def test_a_draft_equal_to_the_target_is_always_accepted(target):
    prompts = random_prompts(6, seed=5)
    expected = build_engine(target).generate(prompts, GREEDY)
    with Counted() as counted:
        assert build_engine(target, speculative=draft(target)).generate(prompts, GREEDY) == expected
    assert counted.proposed > 0 and counted.accepted == counted.proposed


@pytest.mark.usefixtures("weight_bound_step_costs")
@pytest.mark.parametrize("kv", ["auto", "fp8", "int8"])
def test_another_draft_gives_the_same_greedy_tokens_and_backs_off(target, other_draft, kv):
    prompts = random_prompts(6, seed=6)
    expected = build_engine(target, kv_cache_dtype=kv).generate(prompts, GREEDY)
    speculating = build_engine(target, speculative=draft(other_draft), kv_cache_dtype=kv)
    with Counted() as counted:
        assert speculating.generate(prompts, GREEDY) == expected
    # Random weights agree on almost nothing: acceptance collapses and proposals pause, so far
    # fewer tokens are proposed than 4 per sequence per step.
    assert 0 < counted.proposed < len(prompts) * GREEDY.max_tokens


@pytest.mark.slow
@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_smollm2_gives_the_same_greedy_tokens_with_speculation(kv, weight_bound_step_costs):
    """The default model in bf16, asked to repeat a text: n-gram proposals are mostly right and
    a draft equal to the target always is, so runs of several tokens are accepted; not one token
    changes. Step costs follow a weight-bound model, so how many are accepted does not hang on
    the machine's load."""
    folder = ensure_default_model(progress=False)
    tokenizer = Tokenizer(folder)
    text = (
        "The decode worker keeps every running sequence in one batch. Each step it proposes a "
        "few tokens per sequence, checks them all in one forward, and keeps those the model "
        "would have chosen itself, so a step can yield several tokens where it used to yield one."
    )
    request = f"Repeat this text exactly:\n\n{text}"
    prompts = [
        tokenizer.encode_chat([{"role": "user", "content": request}]),
        tokenizer.encode(text),
    ]
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    expected = build_engine(folder, dtype="bfloat16", kv_cache_dtype=kv).generate(prompts, params)
    for speculative in (ngram(), draft(folder)):
        engine = build_engine(folder, dtype="bfloat16", kv_cache_dtype=kv, speculative=speculative)
        with Counted() as counted:
            assert engine.generate(prompts, params) == expected
        assert counted.accepted > len(prompts) * params.max_tokens / 4  # runs were accepted


@pytest.mark.usefixtures("weight_bound_step_costs")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prompts_arriving_together_keep_their_tokens(target, dtype):
    """Under a small budget, decodes share steps with other prompts' prefill chunks: those steps
    verify nothing, so every chunk is cut and computed as without speculation and even bf16
    rounding is unchanged. Once all are decoding, the steps mix speculating and plain rows."""
    prompts = repetitive_prompts(4) + random_prompts(4, seed=9, min_len=60, max_len=120)
    knobs = {"dtype": dtype, "max_num_batched_tokens": 48}
    expected = build_engine(target, **knobs).generate(prompts, GREEDY)
    engine = build_engine(target, **knobs, speculative=draft(target))
    with Counted() as counted:
        assert engine.generate(prompts, GREEDY) == expected
    assert counted.accepted > 0


@pytest.mark.usefixtures("weight_bound_step_costs")
def test_preemption_under_page_pressure_keeps_the_tokens(target):
    """Too few pages for every sequence's proposals: sequences are preempted and recomputed,
    a draft model's KV with them."""
    prompts = random_prompts(8, seed=12, min_len=30, max_len=60)
    params = SamplingParams(max_tokens=48, temperature=0.0)
    expected = build_engine(target).generate(prompts, params)
    engine = build_engine(target, speculative=draft(target), num_pages=32)
    assert engine.generate(prompts, params) == expected
    assert engine.scheduler.num_preemptions > 0


# -- stops inside an accepted run ----------------------------------------------------------------


def test_stops_that_land_inside_an_accepted_run(target):
    """With the target as its own draft every proposal is accepted, so each step yields five
    tokens, and every stop must cut the run at its own token."""
    prompt = random_prompts(1, seed=21)[0]
    plain = build_engine(target)
    free = plain.generate([prompt], SamplingParams(max_tokens=40, temperature=0.0))[0]
    stop_token = free[7]
    cases = [
        SamplingParams(max_tokens=13, temperature=0.0),
        SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=[stop_token]),
        SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=[stop_token], min_tokens=9),
    ]
    speculating = build_engine(target, speculative=draft(target))
    for params in cases:
        expected = plain.generate([prompt], params)[0]
        assert speculating.generate([prompt], params)[0] == expected
    assert len(plain.generate([prompt], cases[1])[0]) == free.index(stop_token) + 1


def test_eos_inside_an_accepted_run(tmp_path):
    """The model's EOS stops the run on the token itself; ignore_eos runs through it."""
    folder = build_tiny_model("llama3-rope", tmp_path / "eos")
    prompt = random_prompts(1, seed=22)[0]
    free = build_engine(folder).generate([prompt], GREEDY)[0]
    # Make the model's EOS a token greedy decoding reaches a few steps in.
    config_file = folder / "config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps(config | {"eos_token_id": free[6]}))
    plain, speculating = build_engine(folder), build_engine(folder, speculative=draft(folder))
    for params in (GREEDY, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)):
        expected = plain.generate([prompt], params)[0]
        assert speculating.generate([prompt], params)[0] == expected
    assert plain.generate([prompt], GREEDY)[0] == free[: free.index(free[6]) + 1]


def test_only_accepted_tokens_reach_the_prefix_cache(target, other_draft):
    """Rejected proposals wrote KV into pages that later tokens overwrite; none of it may be
    filed in the prefix cache. A prompt that continues a finished sequence hits its pages and
    must continue exactly as the sequence did."""
    engine = build_engine(target, speculative=draft(other_draft))
    prompt = random_prompts(1, seed=23, min_len=20, max_len=20)[0]
    first = engine.generate([prompt], SamplingParams(max_tokens=60, temperature=0.0))[0]
    follow = prompt + first[:40]
    engine.add_request(follow, SamplingParams(max_tokens=20, temperature=0.0), "follow")
    outputs = []
    while engine.has_unfinished:
        outputs += engine.step()
    assert outputs[0].num_cached_tokens == 48  # three full pages of the 60 known tokens
    assert [s.token_id for o in outputs for s in o.new_samples] == first[40:60]


# -- sampling ------------------------------------------------------------------------------------


@pytest.mark.usefixtures("weight_bound_step_costs")
def test_seeded_sampling_gives_the_same_tokens_with_speculation(target):
    """A seeded row's noise depends on (seed, step) alone, so speculation changes no token of
    it, with penalties and filters in play. A low temperature, so that the seeded picks often
    match the draft's greedy proposals (about half of them are accepted): at 0.8 about one in
    twelve was, and in about one run of five none at all."""
    prompts = repetitive_prompts(6)
    params = [
        SamplingParams(
            max_tokens=30,
            temperature=0.1,
            seed=i,
            top_k=20,
            top_p=0.9,
            repetition_penalty=1.1,
            frequency_penalty=0.2,
        )
        for i in range(len(prompts))
    ]
    expected = build_engine(target).generate(prompts, params)
    with Counted() as counted:
        assert build_engine(target, speculative=draft(target)).generate(prompts, params) == expected
    assert 0 < counted.accepted < counted.proposed


@pytest.mark.usefixtures("weight_bound_step_costs")
def test_whitelists_and_bad_words_give_the_same_tokens_with_speculation(target):
    """A draft equal to the target proposes what the target says without a whitelist or bad
    words, and verification samples under them, a run's proposals counting as output for the
    bad words: speculation changes no token, and the proposals they rule out are rejected."""
    prompts = repetitive_prompts(4)
    greedy = SamplingParams(max_tokens=30, temperature=0.0)
    plain = build_engine(target).generate(prompts, [greedy] * len(prompts))
    params = [
        SamplingParams(max_tokens=30, temperature=0.0, bad_words_token_ids=[[out[2]], out[5:8]])
        if i % 2
        else SamplingParams(
            max_tokens=30, temperature=0.0, allowed_token_ids=sorted(set(out) - {out[4]})
        )
        for i, out in enumerate(plain)
    ]
    expected = build_engine(target).generate(prompts, params)
    assert all(ours != theirs for ours, theirs in zip(expected, plain, strict=True))
    with Counted() as counted:
        assert build_engine(target, speculative=draft(target)).generate(prompts, params) == expected
    assert 0 < counted.accepted < counted.proposed


def test_logprobs_are_reported_for_every_token_of_a_run(target):
    prompt = random_prompts(1, seed=24)[0]
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=2)
    engine = build_engine(target, speculative=draft(target))
    engine.add_request(prompt, params, "r")
    samples = []
    while engine.has_unfinished:
        for output in engine.step():
            samples += output.new_samples
    assert len(samples) == 12
    for sample in samples:
        assert sample.logprob == pytest.approx(sample.top_logprobs[0][1])
        assert sample.token_id == sample.top_logprobs[0][0]


TINY_VOCAB = 6
NUM_DRAWS = 3000


def tiny_vocab_model(folder, seed: int):
    # Spread-out distributions over a tiny vocabulary: every outcome is seen.
    return build_tiny_model(
        "llama3-rope",
        folder,
        seed,
        vocab_size=TINY_VOCAB,
        max_position_embeddings=128,
        initializer_range=0.08,
    )


def exact_joint(folder, prompt: list[int]) -> torch.Tensor:
    """P(t1, t2, t3) of the first three sampled tokens at temperature 1, from transformers."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    v = TINY_VOCAB

    def next_probs(prefixes: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return model(prefixes).logits[:, -1].softmax(-1)

    base = torch.tensor([prompt])
    p1 = next_probs(base)[0]  # [v]
    ones = torch.arange(v)[:, None]
    p2 = next_probs(torch.cat([base.expand(v, -1), ones], 1))  # [v, v]
    twos = torch.cartesian_prod(torch.arange(v), torch.arange(v))
    p3 = next_probs(torch.cat([base.expand(v * v, -1), twos], 1)).view(v, v, v)
    return p1[:, None, None] * p2[:, :, None] * p3


def chi_square_p_value(observed: torch.Tensor, expected_probs: torch.Tensor, draws: int) -> float:
    """Pearson's test, cells with fewer than 5 expected draws pooled into one."""
    expected = expected_probs.flatten().double() * draws
    observed = observed.flatten().double()
    small = expected < 5
    cells_e = torch.cat([expected[~small], expected[small].sum()[None]])
    cells_o = torch.cat([observed[~small], observed[small].sum()[None]])
    statistic = float(((cells_o - cells_e) ** 2 / cells_e).sum())
    dof = len(cells_e) - 1
    # Wilson-Hilferty: the chi-square tail through a normal one, accurate at these dofs.
    z = ((statistic / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


@pytest.mark.usefixtures("weight_bound_step_costs")
@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_sampled_distribution_is_the_targets(tmp_path, proposer):
    """Temperature 1 on a six-token vocabulary: 3000 seeded requests draw three tokens each,
    the last two through verification. The joint distribution of the three must be the
    target's: a chi-square test over its 216 cells (p > 0.001; the seeds are fixed, so the
    outcome is too), with proposals both accepted and rejected along the way."""
    folder = tiny_vocab_model(tmp_path / "target", seed=4)
    draft_folder = tiny_vocab_model(tmp_path / "draft", seed=5)
    prompt = [0, 1, 2, 3, 4, 5] * 2 + [0, 1]  # every token recurs: n-grams always match
    spec = ngram(k=2) if proposer == "ngram" else draft(draft_folder, k=2)
    # Waves of 64: each wave's prompts are prefilled in one step and then decode by themselves,
    # since proposals wait for steps of decodes alone.
    engine = build_engine(
        folder, speculative=spec, num_pages=2048, max_num_batched_tokens=2048, max_num_seqs=64
    )
    params = [SamplingParams(max_tokens=3, temperature=1.0, seed=i) for i in range(NUM_DRAWS)]
    with Counted() as counted:
        samples = engine.generate([prompt] * NUM_DRAWS, params)
    assert 0 < counted.accepted < counted.proposed
    observed = torch.zeros(TINY_VOCAB, TINY_VOCAB, TINY_VOCAB)
    for t1, t2, t3 in samples:
        observed[t1, t2, t3] += 1
    p_value = chi_square_p_value(observed, exact_joint(folder, prompt), NUM_DRAWS)
    assert p_value > 1e-3, f"p = {p_value:.2e}"


# -- policy --------------------------------------------------------------------------------------


def test_step_costs_interpolate_between_measured_row_counts():
    costs = StepCosts()
    assert costs.estimate(8) is None
    costs.observe(8, 0.010)
    assert costs.estimate(4) == costs.estimate(40) == 0.010  # flat beyond what was measured
    costs.observe(24, 0.030)
    assert costs.estimate(16) == pytest.approx(0.020)
    costs.observe(8, 0.020)  # a moving average, not the last measurement
    assert 0.010 < costs.estimate(8) < 0.020


def decoding_sequences(count: int, acceptance: float) -> list[Sequence]:
    seqs = [
        Sequence.from_prompt(f"s{i}", [1, 2, 3], SamplingParams(max_tokens=100))
        for i in range(count)
    ]
    for seq in seqs:
        seq.speculation.acceptance = acceptance
    return seqs


def test_slots_are_planned_by_what_rows_cost():
    speculator = Speculator(ngram(k=4), NgramProposer(1, 4))
    seqs = decoding_sequences(8, acceptance=0.9)
    # Nothing measured yet: a quarter more rows are tried, which measures what they cost.
    assert sum(speculator.plan_slots(seqs, 512)) == 2
    # Then a quarter more past the largest measured step, never a huge untried one.
    speculator.costs.observe(8, 0.040)
    speculator.costs.observe(10, 0.041)
    assert sum(speculator.plan_slots(seqs, 512)) == 4
    # Rows nearly free (a memory-bound step): all slots still pay.
    for rows in (8, 40):
        speculator.costs.observe(rows, 0.040 + rows * 1e-5)
    assert speculator.plan_slots(seqs, 512) == [4] * 8
    # Every row as dear as the next (a compute-bound step): a token earned with chance < 1
    # never pays for its row.
    speculator.costs = StepCosts()
    for rows in (8, 40):
        speculator.costs.observe(rows, rows * 0.005)
    assert speculator.plan_slots(seqs, 512) == [0] * 8
    # In between, the likeliest slots go first: the sequence that accepts more gets more.
    speculator.costs = StepCosts()
    speculator.costs.observe(2, 0.020)
    speculator.costs.observe(10, 0.040)
    confident, doubtful = decoding_sequences(2, acceptance=0.95)[0], decoding_sequences(1, 0.5)[0]
    planned = speculator.plan_slots([confident, doubtful], 512)
    assert planned[0] > planned[1] >= 0 and planned[0] >= 2


def test_slots_stop_at_max_tokens_and_the_model_length():
    speculator = Speculator(ngram(k=4), NgramProposer(1, 4))
    for rows in (1, 5):  # rows measured free: only the limits below can stop a slot
        speculator.costs.observe(rows, 0.010)
    [near_max_tokens] = decoding_sequences(1, acceptance=1.0)
    near_max_tokens.token_ids += [7] * 97  # 97 of 100 tokens generated: 3 to go
    assert speculator.plan_slots([near_max_tokens], 512) == [2]
    [near_model_end] = decoding_sequences(1, acceptance=1.0)
    assert speculator.plan_slots([near_model_end], max_model_len=5) == [1]


def test_no_proposals_above_the_batch_size_limit(target):
    prompts = repetitive_prompts(6)
    with Counted() as counted:
        build_engine(target, speculative=ngram(disable_by_batch_size=4)).generate(
            prompts, SamplingParams(max_tokens=3, temperature=0.0)
        )
    # Six sequences decode together for their few steps: nobody proposes.
    assert counted.proposed == 0


def test_bad_speculative_settings_are_refused(target):
    for spec, message in [
        (SpeculativeConfig(method="medusa"), "must be one of"),
        (SpeculativeConfig(method="ngram", num_speculative_tokens=0), "num-speculative-tokens"),
        (SpeculativeConfig(method="ngram", ngram_min=3, ngram_max=2), "ngram"),
        (SpeculativeConfig(method="draft"), "speculative-model"),
    ]:
        with pytest.raises(ValueError, match=message):
            spec.validate()
