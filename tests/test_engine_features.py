"""The one-process engine: prefix cache, eviction under memory pressure, and bad input."""

from __future__ import annotations

import json
import shutil

import pytest
from tiny_models import build_tiny_model, random_prompts

from common.config import CacheConfig, EngineConfig, SchedulerConfig
from common.engine.llm_engine import LLMEngine
from common.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=16, temperature=0.0)


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    return build_tiny_model("qwen2-bias", tmp_path_factory.mktemp("qwen2"))


def make_engine(folder, num_blocks=256, block_size=16, prefix_caching=True, chunk=2048, **kw):
    return LLMEngine(
        EngineConfig(
            model=str(folder),
            dtype="float32",
            device="cpu",
            cache=CacheConfig(
                block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=prefix_caching
            ),
            scheduler=SchedulerConfig(
                max_num_batched_tokens=chunk, max_model_len=kw.get("max_model_len", 256)
            ),
        )
    )


def test_shared_prefix_reuses_pages_and_computes_only_the_suffix(model_folder):
    shared = random_prompts(1, seed=1, min_len=48, max_len=48)[0]
    first = [*shared, 5, 6, 7]
    second = [*shared, 9, 10, 11, 12, 13]
    engine = make_engine(model_folder)
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
    fresh = make_engine(model_folder, prefix_caching=False)
    assert tokens == fresh.generate([second], GREEDY)[0]


def test_identical_prompt_recomputes_only_its_last_token(model_folder):
    prompt = random_prompts(1, seed=2, min_len=32, max_len=32)[0]
    engine = make_engine(model_folder)
    expected = engine.generate([prompt], GREEDY)[0]
    before = engine.scheduler.num_prompt_tokens_computed
    assert engine.generate([prompt], GREEDY)[0] == expected
    # 32 tokens = 2 full pages, but the last token must run to give logits: one page is reused.
    assert engine.scheduler.num_prompt_tokens_computed - before == 16


def test_memory_pressure_evicts_and_preempts_without_changing_tokens(model_folder):
    prompts = random_prompts(12, seed=3, min_len=20, max_len=40)
    params = SamplingParams(max_tokens=24, temperature=0.0)
    roomy = make_engine(model_folder).generate(prompts, params)
    # 20 pages of 4 tokens: two sequences at most fit at once.
    tight = make_engine(model_folder, num_blocks=20, block_size=4, max_model_len=80)
    assert tight.generate(prompts, params) == roomy
    assert tight.scheduler.num_preemptions > 0
    assert tight.block_manager.num_free_blocks == 20


def test_prompt_over_max_model_len_names_the_limit(model_folder):
    engine = make_engine(model_folder, max_model_len=64)
    with pytest.raises(ValueError, match="maximum model length is 64"):
        engine.add_request(list(range(1, 65)), GREEDY)


def test_unsupported_architecture_names_the_supported_ones(model_folder, tmp_path):
    folder = tmp_path / "gpt2"
    shutil.copytree(model_folder, folder)
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"LlamaForCausalLM.*Qwen3ForCausalLM"):
        make_engine(folder)


def test_missing_weights_are_a_clear_error(model_folder, tmp_path):
    folder = tmp_path / "noweights"
    shutil.copytree(model_folder, folder)
    (folder / "model.safetensors").unlink()
    with pytest.raises(ValueError, match=r"no \*\.safetensors"):
        make_engine(folder)


def test_corrupt_weights_are_a_clear_error(model_folder, tmp_path):
    folder = tmp_path / "corrupt"
    shutil.copytree(model_folder, folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ValueError, match="corrupt weight file"):
        make_engine(folder)


def test_missing_folder_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        make_engine(tmp_path / "nothing-here")
