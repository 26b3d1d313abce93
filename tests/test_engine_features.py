"""The one-process engine: prefix cache, eviction under memory pressure, and bad input."""

from __future__ import annotations

import json
import shutil

import pytest
from engines import build_engine
from tiny_models import build_tiny_model, random_prompts

from common.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=16, temperature=0.0)
# The engines here, unless a test says otherwise: a batch of prompts in one step, prompts of up
# to 256 tokens.
KNOBS = {"max_num_batched_tokens": 2048, "max_model_len": 256}


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    return build_tiny_model("qwen2-bias", tmp_path_factory.mktemp("qwen2"))


def test_shared_prefix_reuses_pages_and_computes_only_the_suffix(model_folder):
    shared = random_prompts(1, seed=1, min_len=48, max_len=48)[0]
    first = [*shared, 5, 6, 7]
    second = [*shared, 9, 10, 11, 12, 13]
    engine = build_engine(model_folder, **KNOBS)
    engine.generate([first], GREEDY)
    computed_before = engine.scheduler.num_prompt_tokens_computed
    request_id = engine.add_request(second, GREEDY)
    tokens, cached = [], None
    while engine.has_unfinished:
        for out in engine.step():
            assert out.request_id == request_id
            tokens += [s.token_id for s in out.new_samples]
            cached = out.num_cached_tokens
    assert cached == 48  # three full pages of 16
    assert engine.scheduler.num_prompt_tokens_computed - computed_before == len(second) - 48
    fresh = build_engine(model_folder, **KNOBS, prefix_caching=False)
    assert tokens == fresh.generate([second], GREEDY)[0]


def test_identical_prompt_recomputes_only_its_last_token(model_folder):
    prompt = random_prompts(1, seed=2, min_len=32, max_len=32)[0]
    engine = build_engine(model_folder, **KNOBS)
    expected = engine.generate([prompt], GREEDY)[0]
    before = engine.scheduler.num_prompt_tokens_computed
    assert engine.generate([prompt], GREEDY)[0] == expected
    # 32 tokens = 2 full pages, but the last token must run to give logits: one page is reused.
    assert engine.scheduler.num_prompt_tokens_computed - before == 16


def test_memory_pressure_evicts_and_preempts_without_changing_tokens(model_folder):
    prompts = random_prompts(12, seed=3, min_len=20, max_len=40)
    params = SamplingParams(max_tokens=24, temperature=0.0)
    roomy = build_engine(model_folder, **KNOBS).generate(prompts, params)
    # 20 pages of 4 tokens: two sequences at most fit at once.
    tight = build_engine(
        model_folder, num_pages=20, page_size=4, max_num_batched_tokens=2048, max_model_len=80
    )
    assert tight.generate(prompts, params) == roomy
    assert tight.scheduler.num_preemptions > 0
    assert tight.page_manager.num_free_pages == 20


def test_prompt_over_max_model_len_names_the_limit(model_folder):
    engine = build_engine(model_folder, max_num_batched_tokens=2048, max_model_len=64)
    with pytest.raises(ValueError, match="maximum model length is 64"):
        engine.add_request(list(range(1, 65)), GREEDY)


def test_unsupported_architecture_names_the_supported_ones(model_folder, tmp_path):
    folder = tmp_path / "gpt2"
    shutil.copytree(model_folder, folder)
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"LlamaForCausalLM.*Qwen3ForCausalLM"):
        build_engine(folder, **KNOBS)


def test_missing_weights_are_a_clear_error(model_folder, tmp_path):
    folder = tmp_path / "noweights"
    shutil.copytree(model_folder, folder)
    (folder / "model.safetensors").unlink()
    with pytest.raises(ValueError, match=r"no \*\.safetensors"):
        build_engine(folder, **KNOBS)


def test_corrupt_weights_are_a_clear_error(model_folder, tmp_path):
    folder = tmp_path / "corrupt"
    shutil.copytree(model_folder, folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ValueError, match="corrupt weight file"):
        build_engine(folder, **KNOBS)


def test_missing_folder_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        build_engine(tmp_path / "nothing-here", **KNOBS)


def prompt_logprobs_of(engine, prompt, params):
    """The engine's (tokens, prompt logprobs, cached tokens) for one request."""
    request_id = engine.add_request(prompt, params)
    tokens, scored, cached = [], None, None
    while engine.has_unfinished:
        for out in engine.step():
            assert out.request_id == request_id
            if out.prompt_logprobs is not None:
                assert scored is None and not tokens  # once, with the first token
                scored = out.prompt_logprobs
            tokens += [s.token_id for s in out.new_samples]
            cached = out.num_cached_tokens
    return tokens, scored, cached


@pytest.mark.parametrize("chunk", [2048, 7], ids=["one-chunk", "chunks-of-7"])
def test_prompt_logprobs_equal_transformers_and_skip_the_prefix_cache(
    model_folder, chunk, monkeypatch
):
    import torch
    from transformers import AutoModelForCausalLM

    from common.engine import sampler

    monkeypatch.setattr(sampler, "_PROMPT_ROWS_PER_SLICE", 16)  # a 40-row chunk in 3 slices

    prompt = random_prompts(1, seed=5, min_len=40, max_len=40)[0]
    reference = AutoModelForCausalLM.from_pretrained(model_folder, dtype=torch.float32)
    with torch.no_grad():
        logits = reference(torch.tensor([prompt])).logits[0].float()
    expected = torch.log_softmax(logits, dim=-1)  # row p scores token p + 1

    engine = build_engine(model_folder, max_num_batched_tokens=chunk, max_model_len=256)
    plain = engine.generate([prompt], GREEDY)[0]  # warms the prefix cache with the prompt
    params = SamplingParams(max_tokens=16, temperature=0.0, prompt_logprobs=3)
    tokens, scored, cached = prompt_logprobs_of(engine, prompt, params)
    assert tokens == plain and cached == 0  # every position computed, not read from cache
    assert [p.token_id for p in scored] == prompt[1:]
    for position, p in enumerate(scored):
        row = expected[position]
        assert p.logprob == pytest.approx(row[prompt[position + 1]].item(), abs=1e-4)
        assert p.rank == int((row > row[p.token_id] + 1e-6).sum()) + 1
        top_ids = [t for t, _ in p.top_logprobs]
        assert top_ids == row.topk(3).indices.tolist()
        assert [lp for _, lp in p.top_logprobs] == pytest.approx(
            row.topk(3).values.tolist(), abs=1e-4
        )
    # Asked for zero alternatives: the prompt tokens' own logprobs only.
    _, none_top, _ = prompt_logprobs_of(
        engine, prompt, SamplingParams(max_tokens=2, prompt_logprobs=0)
    )
    assert [p.top_logprobs for p in none_top] == [[]] * 39
    # Without asking, a repeat reads the cache and nothing is scored.
    assert prompt_logprobs_of(engine, prompt, GREEDY)[1:] == (None, 32)


def test_prompt_logprobs_survive_preemption_once(model_folder):
    """Sequences preempted mid-prompt are recomputed: their prompt logprobs are still reported
    once, position by position, equal to an unpressured engine's."""
    prompts = random_prompts(6, seed=6, min_len=30, max_len=40)
    params = SamplingParams(max_tokens=12, temperature=0.0, prompt_logprobs=1)

    def run(engine):
        ids = [engine.add_request(p, params) for p in prompts]
        scored = {}
        while engine.has_unfinished:
            for out in engine.step():
                if out.prompt_logprobs is not None:
                    assert out.request_id not in scored
                    scored[out.request_id] = [(p.token_id, p.rank) for p in out.prompt_logprobs]
        return [scored[i] for i in ids]

    roomy = run(build_engine(model_folder, **KNOBS))
    tight = build_engine(
        model_folder, num_pages=24, page_size=4, max_num_batched_tokens=16, max_model_len=80
    )
    assert run(tight) == roomy
    assert tight.scheduler.num_preemptions > 0
    assert [[t for t, _ in s] for s in roomy] == [p[1:] for p in prompts]


class AroundForwardLog:
    """Records what the runner tells the worker's step helper, beside the forward's calls."""

    def __init__(self, events: list[str]) -> None:
        self.events = events

    def __enter__(self):
        self.events.append("enter")
        return self

    def __exit__(self, *exc_info) -> None:
        self.events.append("exit")

    def device_launched(self) -> None:
        self.events.append("launched")


def test_the_step_helper_hears_of_the_launch_between_the_forward_and_the_sampling(model_folder):
    """On a GPU the worker's loop sends its previous step's tokens when told the forward is
    launched (StepIO's pulse_inline): after the forward's call, before the sampler waits for
    logits, once a step, prefill and decode alike."""
    engine = build_engine(model_folder)
    events: list[str] = []
    forward, argmax, sample = engine.runner.model, engine.sampler.argmax, engine.sampler.sample

    def logged(name, call):
        def run(*args, **kwargs):
            if events[-1] != name:  # sample may hand a plain batch to argmax
                events.append(name)
            return call(*args, **kwargs)

        return run

    engine.runner.model = logged("forward", forward)
    engine.sampler.argmax = logged("sample", argmax)
    engine.sampler.sample = logged("sample", sample)
    engine.add_request([5, 6, 7, 8], SamplingParams(max_tokens=3, temperature=0.0))
    while engine.has_unfinished:
        engine.run_step(around_forward=AroundForwardLog(events))
    assert events == ["enter", "forward", "launched", "sample", "exit"] * 3
