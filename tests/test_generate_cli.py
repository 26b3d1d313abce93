"""`pdserve generate` on the default model equals transformers' greedy output in float32."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from common.config import EngineConfig, SchedulerConfig
from common.engine.llm_engine import LLMEngine
from common.model.default_model import ensure_default_model
from common.sampling_params import SamplingParams
from common.tokenizer import Tokenizer

pytestmark = pytest.mark.slow  # runs the `pdserve generate` command on the default model

PROMPT = "The capital of France is"


def test_default_model_greedy_equals_transformers_fp32():
    folder = ensure_default_model(progress=False)
    tokenizer = Tokenizer(folder)
    prompts = [tokenizer.encode(PROMPT), tokenizer.encode_chat([{"role": "user", "content": "Hi"}])]
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    expected = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = hf.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False
            )
            expected.append(out[0, len(prompt) :].tolist())
    engine = LLMEngine(EngineConfig(dtype="float32", scheduler=SchedulerConfig(max_model_len=512)))
    got = engine.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0))
    # transformers stops after eos and includes it; so does the engine.
    assert got == expected
    assert "Paris" in tokenizer.decode(got[0])


def test_generate_command_prints_a_coherent_completion():
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pdserve.cli",
            "generate",
            "--prompt",
            PROMPT,
            "--max-tokens",
            "8",
            "--max-model-len",
            "256",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout


def test_generate_command_reports_bad_input_cleanly(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pdserve.cli",
            "generate",
            "--prompt",
            "x",
            "--model",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2
    assert "config.json" in result.stderr
    assert "Traceback" not in result.stderr
