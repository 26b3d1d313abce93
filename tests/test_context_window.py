"""A model whose config has a sliding window is served exactly up to the window, and refuses
what is longer, at the router and in the engine, rather than answering past it wrongly."""

from __future__ import annotations

import shutil

import pytest
from engines import build_engine
from tiny_models import build_tiny_model, hf_greedy, random_prompts

from common.context_window import exact_context_length, sliding_window
from common.model.default_model import ensure_default_model
from common.sampling_params import SamplingParams
from common.tokenizer import Tokenizer
from router.server import build_parser, config_from_args

POSITIONS = {"max_position_embeddings": 4096, "num_hidden_layers": 4}


@pytest.mark.parametrize(
    ("fields", "window"),
    [
        ({}, None),  # Llama: no window
        ({"sliding_window": None}, None),  # Mistral without one
        ({"sliding_window": 512}, 512),  # Mistral: every layer
        ({"sliding_window": 512, "use_sliding_window": False}, None),  # Qwen2's default
        ({"sliding_window": 512, "use_sliding_window": True, "max_window_layers": 4}, None),
        ({"sliding_window": 512, "use_sliding_window": True, "max_window_layers": 2}, 512),
        ({"sliding_window": 512, "layer_types": ["full_attention", "sliding_attention"]}, 512),
        ({"sliding_window": 512, "layer_types": ["full_attention"] * 4}, None),
    ],
)
def test_the_window_is_read_as_each_family_defines_it(fields, window):
    config = POSITIONS | fields
    assert sliding_window(config) == window
    assert exact_context_length(config) == (4096 if window is None else window)
    assert exact_context_length(config | {"max_position_embeddings": 256}) == 256


@pytest.fixture(scope="module")
def windowed_mistral(tmp_path_factory):
    folder = tmp_path_factory.mktemp("windowed")
    return build_tiny_model("mistral", folder, sliding_window=48)


def test_the_engine_answers_within_the_window_as_transformers_and_refuses_past_it(
    windowed_mistral,
):
    engine = build_engine(windowed_mistral, max_model_len=512)
    assert engine.max_model_len == 48
    prompts = random_prompts(3, seed=5, min_len=20, max_len=30)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    assert engine.generate(prompts, greedy) == hf_greedy(windowed_mistral, prompts, 12)
    with pytest.raises(ValueError, match="maximum model length is 48"):
        engine.add_request(list(range(1, 49)), greedy)


def test_the_router_caps_its_context_at_the_window(tmp_path):
    folder = build_tiny_model(
        "mistral", tmp_path / "m", sliding_window=48, vocab_size=49152, max_position_embeddings=1024
    )
    source = ensure_default_model(progress=False)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, folder / name)
    text = Tokenizer(folder)
    for flags in ([], ["--max-model-len", "512"], ["--max-model-len", "32"]):
        config = config_from_args(build_parser().parse_args(flags), text, folder)
        assert config.max_model_len == (32 if flags[-1:] == ["32"] else 48)
