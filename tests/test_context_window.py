"""A config's sliding windows are read per layer as ``transformers`` reads them, and the context
is the model's positions, window or not, at the router as in the engine."""

from __future__ import annotations

import shutil

import pytest
from tiny_models import build_tiny_model
from transformers import MistralConfig, Qwen2Config, Qwen3Config

from common.context_window import layer_windows, max_positions
from common.model.default_model import ensure_default_model
from common.tokenizer import Tokenizer
from router.server import build_parser, config_from_args

LAYERS = {"num_hidden_layers": 4}


@pytest.mark.parametrize(
    ("fields", "windows"),
    [
        ({"model_type": "llama"}, [None] * 4),
        ({"model_type": "llama", "sliding_window": 512}, [None] * 4),  # Llama reads no window
        ({"model_type": "mistral", "sliding_window": None}, [None] * 4),
        ({"model_type": "mistral", "sliding_window": 0}, [None] * 4),
        ({"model_type": "mistral", "sliding_window": 512}, [512] * 4),
        # Mistral's model ignores layer_types: every layer slides.
        (
            {"model_type": "mistral", "sliding_window": 512, "layer_types": ["full_attention"] * 4},
            [512] * 4,
        ),
        ({"model_type": "qwen2", "sliding_window": 512}, [None] * 4),  # use_sliding_window off
        (
            {"model_type": "qwen2", "sliding_window": 512, "use_sliding_window": True},
            [None] * 4,  # max_window_layers is 28 unless given
        ),
        (
            {
                "model_type": "qwen3",
                "sliding_window": 512,
                "use_sliding_window": True,
                "max_window_layers": 1,
            },
            [None, 512, 512, 512],
        ),
        (
            {
                "model_type": "qwen2",
                "sliding_window": 512,
                "use_sliding_window": True,
                "max_window_layers": 1,
                "layer_types": ["sliding_attention", "full_attention"] * 2,
            },
            [512, None, 512, None],  # layer_types, where given, wins
        ),
        ({"sliding_window": 512}, [512] * 4),  # no family: every layer
        (
            {"sliding_window": 512, "layer_types": ["full_attention", "sliding_attention"] * 2},
            [None, 512, None, 512],
        ),
    ],
)
def test_each_layers_window_is_read_as_its_family_defines_it(fields, windows):
    assert layer_windows(LAYERS | fields) == tuple(windows)


@pytest.mark.parametrize(
    "config",
    [
        Qwen2Config(num_hidden_layers=6, use_sliding_window=True, max_window_layers=4),
        Qwen2Config(num_hidden_layers=6, use_sliding_window=False, max_window_layers=0),
        Qwen3Config(num_hidden_layers=6, use_sliding_window=True, max_window_layers=2),
        Qwen3Config(num_hidden_layers=3, use_sliding_window=True, sliding_window=None),
        MistralConfig(num_hidden_layers=3, sliding_window=4096),
        MistralConfig(num_hidden_layers=3, sliding_window=None),
    ],
    ids=lambda config: config.model_type,
)
def test_the_windows_are_transformers_own(config):
    """As saved (``layer_types`` written out) and as an older config without ``layer_types``."""
    types = getattr(config, "layer_types", None) or ["sliding_attention"] * 3
    expected = tuple(
        config.sliding_window if kind == "sliding_attention" else None for kind in types
    )
    saved = config.to_dict()
    assert layer_windows(saved) == expected
    saved.pop("layer_types", None)
    assert layer_windows(saved) == expected


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"sliding_window": -4}, "sliding_window must be"),
        ({"sliding_window": 1.5}, "sliding_window must be"),
        ({"sliding_window": True}, "sliding_window must be"),
        ({"sliding_window": 8, "layer_types": ["full_attention"]}, "each of the 4 layers"),
        ({"sliding_window": 8, "layer_types": ["local"] * 4}, "not \\['local'\\]"),
        (
            {"model_type": "qwen2", "sliding_window": 8, "use_sliding_window": True,
             "max_window_layers": -1},
            "max_window_layers",
        ),
        ({"num_hidden_layers": None, "sliding_window": 8}, "num_hidden_layers"),
    ],
)  # fmt: skip
def test_a_window_that_makes_no_sense_is_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        layer_windows(LAYERS | fields)


def test_the_context_is_the_models_positions_window_or_not():
    assert max_positions({"max_position_embeddings": 256, "sliding_window": 48}) == 256
    assert max_positions({}) == 4096


def test_the_router_takes_the_positions_not_the_window(tmp_path):
    folder = build_tiny_model(
        "mistral", tmp_path / "m", sliding_window=48, vocab_size=49152, max_position_embeddings=1024
    )
    source = ensure_default_model(progress=False)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, folder / name)
    text = Tokenizer(folder)
    for flags, expected in (([], 1024), (["--max-model-len", "512"], 512)):
        config = config_from_args(build_parser().parse_args(flags), text, folder)
        assert config.max_model_len == expected
