"""Models with sliding windows, served: greedy tokens of prompts longer than the window, and of
generations that run past it, equal ``transformers``' (float32) on every attention backend, in
chunked prefill, after prefix-cache hits and with speculative decoding; a running sequence gives
back the pages behind the window when every layer slides, and none when a layer does not.

Tiny random models in float32 give ``transformers``' tokens exactly; the seeds and prompts here
are fixed, and none of them meets a near tie.
"""

from __future__ import annotations

import json
import shutil

import pytest
from engines import build_engine
from tiny_models import build_tiny_model, hf_greedy, random_prompts

from common import metrics
from common.config import SpeculativeConfig
from common.engine.llm_engine import LLMEngine
from common.sampling_params import SamplingParams

WINDOW = 24  # a page and a half of 16 positions
NEW_TOKENS = 40


def greedy(max_tokens: int = NEW_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    """A tiny Mistral whose every layer reads the last 24 positions."""
    return build_tiny_model("mistral", tmp_path_factory.mktemp("mistral"), sliding_window=WINDOW)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    """Prompts of 30 to 70 tokens: longer than the window, and the answers run past it too."""
    return random_prompts(3, seed=5, min_len=30, max_len=70)


@pytest.fixture(scope="module")
def expected(mistral, prompts) -> list[list[int]]:
    return hf_greedy(mistral, prompts, NEW_TOKENS)


def test_the_window_changes_the_answers(mistral, prompts, expected, tmp_path):
    """Else every test here would pass with the window ignored."""
    unwindowed = tmp_path / "unwindowed"
    shutil.copytree(mistral, unwindowed)
    config = json.loads((unwindowed / "config.json").read_text())
    config["sliding_window"] = None
    (unwindowed / "config.json").write_text(json.dumps(config))
    assert hf_greedy(unwindowed, prompts, NEW_TOKENS) != expected


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
@pytest.mark.parametrize("chunk", [256, 16, 20], ids=["whole", "chunks-16", "chunks-20"])
def test_greedy_tokens_equal_transformers(
    mistral, prompts, expected, monkeypatch, backend, chunk
) -> None:
    """Whole prompts, and prompts in chunks shorter than the window that cross page edges."""
    monkeypatch.setenv("PDSERVE_ATTENTION_BACKEND", backend)
    engine = build_engine(mistral, max_num_batched_tokens=chunk)
    assert engine.generate(prompts, greedy()) == expected
    assert engine.scheduler.num_released_pages > 0


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_a_prefix_cache_hit_answers_as_transformers(mistral, monkeypatch, backend) -> None:
    """A prompt that shares 48 tokens (three pages) with one served before starts after them."""
    monkeypatch.setenv("PDSERVE_ATTENTION_BACKEND", backend)
    engine = build_engine(mistral)
    [first, second] = random_prompts(2, seed=9, min_len=60, max_len=60)
    assert engine.generate([first], greedy()) == hf_greedy(mistral, [first], NEW_TOKENS)
    assert cached_tokens_of(engine, first[:48] + second[:20], NEW_TOKENS) == 48


def test_a_released_page_is_a_hit_until_the_pool_reuses_it(mistral) -> None:
    """Pages given back from behind the window stay filed in the prefix cache: a prompt that
    starts with them finds them there, until another sequence's pages take their place."""
    engine = build_engine(mistral, num_pages=16, max_model_len=256)
    [first, other] = random_prompts(2, seed=3, min_len=64, max_len=64)
    answer = engine.generate([first], greedy(100))
    assert answer == hf_greedy(mistral, [first], 100)

    extended = first + other[:8]
    assert cached_tokens_of(engine, extended, 8) == 64
    assert engine.generate([other], greedy(150)) == hf_greedy(mistral, [other], 150)
    assert engine.scheduler.num_released_pages > 0
    # The first answer's pages went back behind the window as it ran; the other prompt's
    # took some of them over. What is left of the chain is a hit, nothing past it.
    again = first + answer[0][:90]
    hits = engine.page_manager.match_prefix(again)
    assert 0 < len(hits) < len(again) // 16
    assert cached_tokens_of(engine, again, 8) == 16 * len(hits)


def cached_tokens_of(engine: LLMEngine, prompt: list[int], max_tokens: int) -> int:
    """Serve ``prompt`` alone; its answer must be transformers'. Returns its cache hits."""
    request_id = engine.add_request(prompt, greedy(max_tokens))
    seq = next(s for s in engine.scheduler.waiting if s.request_id == request_id)
    answer: list[int] = []
    while engine.has_unfinished:
        for output in engine.step():
            answer += [sample.token_id for sample in output.new_samples]
    assert answer == hf_greedy(engine.model_path, [prompt], max_tokens)[0]
    return seq.num_cached_tokens


def test_the_pool_recovers_the_pages_behind_the_window(mistral) -> None:
    """Steps of one long generation: pages go back as the window moves on, so the sequence
    never holds more than the window's pages; the counter counts them."""
    engine = build_engine(mistral, num_pages=16, max_model_len=256)
    [prompt] = random_prompts(1, seed=11, min_len=40, max_len=40)
    engine.add_request(prompt, greedy(200))
    free = []
    while engine.has_unfinished:
        engine.step()
        free.append(engine.page_manager.num_free_pages)
    # Kept whole, the sequence would end up holding 15 pages. Through the window (24
    # positions) and the step's own position it holds at most 3 of 16.
    assert min(free) == 16 - 3
    # The step before the last leaves 40 + 198 positions computed (the last one ends the
    # sequence and frees what is left).
    assert engine.scheduler.num_released_pages == (238 - WINDOW + 1) // 16
    assert engine.page_manager.num_free_pages == 16


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
def test_speculative_verification_through_the_window(mistral, monkeypatch, backend) -> None:
    """n-gram proposals verified in runs of several rows, over pages given back behind them."""
    monkeypatch.setenv("PDSERVE_ATTENTION_BACKEND", backend)
    engine = build_engine(mistral, speculative=SpeculativeConfig("ngram", 3))
    prompts = [p + p for p in random_prompts(3, seed=4, min_len=20, max_len=30)]
    accepted = metrics.SPEC_ACCEPTED._value.get()
    assert engine.generate(prompts, greedy()) == hf_greedy(mistral, prompts, NEW_TOKENS)
    assert metrics.SPEC_ACCEPTED._value.get() > accepted
    assert engine.scheduler.num_released_pages > 0


@pytest.fixture(scope="module")
def qwen2_mixed(tmp_path_factory):
    """A tiny Qwen2 with a full layer (0) and a sliding one (1), as max_window_layers says."""
    return build_tiny_model(
        "qwen2-bias",
        tmp_path_factory.mktemp("qwen2"),
        use_sliding_window=True,
        sliding_window=WINDOW,
        max_window_layers=1,
    )


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
def test_full_and_sliding_layers_together(qwen2_mixed, prompts, monkeypatch, backend) -> None:
    """Each layer attends as its own kind; a page holds both layers' KV, so none goes back."""
    monkeypatch.setenv("PDSERVE_ATTENTION_BACKEND", backend)
    engine = build_engine(qwen2_mixed, max_num_batched_tokens=20)
    assert engine.model_config.layer_windows == (None, WINDOW)
    assert engine.generate(prompts, greedy()) == hf_greedy(qwen2_mixed, prompts, NEW_TOKENS)
    assert engine.scheduler.num_released_pages == 0


def test_a_prefill_worker_keeps_every_page_for_the_handoff(mistral, prompts) -> None:
    """Its prompts leave after their first token with all their pages, chunk after chunk: a
    decode worker gives back those behind the window itself."""
    engine: LLMEngine = build_engine(mistral, role="prefill", max_num_batched_tokens=16)
    for prompt in prompts:
        engine.add_request(prompt, greedy(2))  # its first token does not end it
    while engine.has_unfinished:
        engine.step()
    assert engine.scheduler.num_released_pages == 0
    held = sum(-(-len(prompt) // 16) for prompt in prompts)
    assert engine.page_manager.num_free_pages == 256 - held
