"""LoRA adapters in the one-process engine: greedy tokens of several adapters and the base
model, all in one batch, equal PEFT's model under each (float32, nothing merged); adapters that
pdserve does not compute are refused at load, naming the problem; pages computed under one
adapter never serve another."""

from __future__ import annotations

import json
import shutil
import threading
import time

import pytest
from engines import build_engine
from tiny_loras import peft_greedy, save_tiny_lora
from tiny_models import build_tiny_model, random_prompts, save_tiny_model, tiny_llama_config

from common.config import LoraConfig
from common.engine import lora as lora_manager_module
from common.lora_adapters import LoraModule, adapter_namespace, parse_lora_module
from common.sampling_params import SamplingParams

NEW_TOKENS = 12
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)


@pytest.fixture(scope="module")
def llama_case(tmp_path_factory):
    """A tiny Llama, three adapters (all targets rank 8; q, v and down rank 4 with rsLoRA;
    the MLP alone rank 16) and PEFT's tokens for each and for the base."""
    root = tmp_path_factory.mktemp("lora")
    base = save_tiny_model(tiny_llama_config(), root / "base")
    adapters = {
        "all": save_tiny_lora(base, root / "all", seed=1),
        "rs": save_tiny_lora(
            base,
            root / "rs",
            seed=2,
            rank=4,
            alpha=8,
            use_rslora=True,
            targets=["q_proj", "v_proj", "down_proj"],
        ),
        "mlp": save_tiny_lora(
            base,
            root / "mlp",
            seed=3,
            rank=16,
            alpha=4,
            targets=["gate_proj", "up_proj", "down_proj"],
        ),
    }
    prompts = random_prompts(3, seed=5)
    expected = {
        name: peft_greedy(base, path, prompts, NEW_TOKENS) for name, path in adapters.items()
    }
    expected[None] = peft_greedy(base, None, prompts, NEW_TOKENS)
    return base, adapters, prompts, expected


def lora_config(adapters, **knobs) -> LoraConfig:
    return LoraConfig(
        enable_lora=True, modules={name: str(path) for name, path in adapters.items()}, **knobs
    )


def mixed_batch(prompts, names):
    """Every prompt under every name, interleaved so neighbouring rows differ in adapter."""
    pairs = [(prompt, name) for prompt in prompts for name in names]
    return [p for p, _ in pairs], [n for _, n in pairs]


def test_adapters_differ_from_the_base_and_from_each_other(llama_case):
    _, _, _, expected = llama_case
    outputs = [tuple(map(tuple, tokens)) for tokens in expected.values()]
    assert len(set(outputs)) == len(outputs)


@pytest.mark.parametrize(
    "knobs",
    [
        {"max_loras": 3},  # every adapter in one step, the packed CPU kernels for the base
        {"max_loras": 3, "enforce_eager": True, "max_num_batched_tokens": 24},  # chunked prompts
    ],
)
def test_one_batch_of_adapters_and_the_base_equals_peft(llama_case, knobs):
    base, adapters, prompts, expected = llama_case
    max_loras = knobs.pop("max_loras")
    engine = build_engine(base, lora=lora_config(adapters, max_loras=max_loras), **knobs)
    names = [*adapters, None]
    batch, batch_names = mixed_batch(prompts, names)
    got = engine.generate(batch, GREEDY, lora_names=batch_names)
    want = [
        expected[name][prompts.index(prompt)]
        for prompt, name in zip(batch, batch_names, strict=True)
    ]
    assert got == want


def test_more_adapters_than_slots_wait_and_host_memory_is_lru(llama_case):
    """One device slot, two in host memory, three adapters: requests of the others wait for a
    slot; an adapter evicted from host memory is read from its folder again."""
    base, adapters, prompts, expected = llama_case
    engine = build_engine(base, lora=lora_config(adapters, max_loras=1, max_cpu_loras=2))
    assert len(engine.lora.on_host()) == 2
    names = [*adapters, None]
    batch, batch_names = mixed_batch(prompts, names)
    seen: list[set[str]] = []
    run = engine.runner.run

    def counting(batch_rows, around=None):
        seen.append({item.seq.lora_name for item in batch_rows} - {None})
        return run(batch_rows, around)

    engine.runner.run = counting
    got = engine.generate(batch, GREEDY, lora_names=batch_names)
    assert got == [expected[n][prompts.index(p)] for p, n in zip(batch, batch_names, strict=True)]
    assert max(len(adapters_in_step) for adapters_in_step in seen) == 1
    assert len(engine.lora.on_host()) == 2 and len(engine.lora.on_device()) == 1


def test_an_adapter_read_again_holds_up_no_other_requests_steps(llama_case, monkeypatch):
    """One slot and one adapter in host memory: the other adapter's request waits while its
    folder is read on the reader thread (held there until the test lets it go), and the base
    model's request steps to its end meanwhile; then it runs and answers as PEFT does."""
    base, adapters, prompts, expected = llama_case
    two = {name: adapters[name] for name in ("all", "rs")}
    engine = build_engine(base, lora=lora_config(two, max_loras=1, max_cpu_loras=1))
    assert engine.lora.on_host() == ["rs"]  # the last one given; "all" must be read again
    let_go = threading.Event()
    reader_threads: list[str] = []
    real_load = lora_manager_module.load_adapter

    def held_load(*args, **kwargs):
        reader_threads.append(threading.current_thread().name)
        assert let_go.wait(timeout=60), "the test never let the read go"
        return real_load(*args, **kwargs)

    monkeypatch.setattr(lora_manager_module, "load_adapter", held_load)
    under_adapter = engine.add_request(prompts[0], GREEDY, lora_name="all")
    base_model = engine.add_request(prompts[0], GREEDY)
    tokens: dict[str, list[int]] = {under_adapter: [], base_model: []}
    for _ in range(1000):  # bounded: the base request needs NEW_TOKENS steps
        for output in engine.step():
            tokens[output.request_id] += [s.token_id for s in output.new_samples]
        if len(tokens[base_model]) == NEW_TOKENS:
            break
    assert tokens[base_model] == expected[None][0]
    assert tokens[under_adapter] == [] and engine.scheduler.loading
    let_go.set()
    deadline = time.monotonic() + 60
    while engine.has_unfinished and time.monotonic() < deadline:
        for output in engine.step():
            tokens[output.request_id] += [s.token_id for s in output.new_samples]
    assert tokens[under_adapter] == expected["all"][0]
    assert reader_threads and all(name.startswith("lora-read") for name in reader_threads)
    assert engine.lora.on_host() == ["all"]


def test_an_adapter_that_cannot_be_read_again_fails_its_requests_alone(llama_case, tmp_path):
    base, adapters, prompts, expected = llama_case
    gone = shutil.copytree(adapters["all"], tmp_path / "gone")
    config = lora_config({"gone": gone, "rs": adapters["rs"]}, max_loras=1, max_cpu_loras=1)
    engine = build_engine(base, lora=config)
    assert engine.lora.on_host() == ["rs"]
    shutil.rmtree(gone)
    failing = engine.add_request(prompts[0], GREEDY, lora_name="gone")
    fine = engine.add_request(prompts[0], GREEDY, lora_name="rs")
    errors: dict[str, str | None] = {}
    tokens: list[int] = []
    deadline = time.monotonic() + 60
    while engine.has_unfinished and time.monotonic() < deadline:
        for output in engine.step():
            if output.request_id == failing:
                errors[failing] = output.error
            else:
                tokens += [s.token_id for s in output.new_samples]
    assert not engine.has_unfinished
    assert "gone" in (errors[failing] or "") and "could not be read again" in errors[failing]
    assert tokens == expected["rs"][0] and fine not in errors
    assert engine.page_manager.num_free_pages == engine.page_manager.num_pages


def test_the_same_prompt_under_two_adapters_shares_no_pages(llama_case):
    base, adapters, _, _ = llama_case
    engine = build_engine(base, lora=lora_config(adapters, max_loras=2))
    prompt = random_prompts(1, seed=9, min_len=70, max_len=71)[0]
    params = SamplingParams(max_tokens=2, temperature=0.0)

    def cached(name):
        request_id = engine.add_request(prompt, params, lora_name=name)
        seq = next(s for s in engine.scheduler.sequences() if s.request_id == request_id)
        while engine.has_unfinished:
            engine.step()
        return seq.num_cached_tokens, set(seq.page_hashes)

    first, pages_all = cached("all")
    again, _ = cached("all")
    other, pages_rs = cached("rs")
    base_hit, pages_base = cached(None)
    assert first == 0 and again == 64  # the adapter's own pages serve it again
    assert other == 0 and base_hit == 0
    assert not pages_all & pages_rs and not pages_all & pages_base and not pages_rs & pages_base


def test_unknown_adapter_names_are_refused(llama_case):
    base, adapters, prompts, _ = llama_case
    engine = build_engine(base, lora=lora_config(adapters))
    with pytest.raises(ValueError, match="'nope' does not exist"):
        engine.add_request(prompts[0], GREEDY, lora_name="nope")
    plain = build_engine(base)
    with pytest.raises(ValueError, match="serves none"):
        plain.add_request(prompts[0], GREEDY, lora_name="all")


def rewrite_config(folder, **fields):
    config_file = folder / "adapter_config.json"
    config = json.loads(config_file.read_text()) | fields
    config_file.write_text(json.dumps(config))


def test_adapters_pdserve_does_not_compute_are_refused_by_name(llama_case, tmp_path):
    base, adapters, _, _ = llama_case
    engine = build_engine(base, lora=LoraConfig(enable_lora=True, max_lora_rank=8))
    manager = engine.lora

    def copy(name):
        folder = tmp_path / name
        shutil.copytree(adapters["all"], folder)
        return folder

    with pytest.raises(ValueError, match="rank 16 is above --max-lora-rank 8"):
        manager.add("big", str(adapters["mlp"]))
    cases = {
        "dora": ({"use_dora": True}, "use_dora=True is not served"),
        "bias": ({"bias": "all"}, "bias='all' is not served"),
        "ia3": ({"peft_type": "IA3"}, "peft_type 'IA3' is not served"),
        "head": ({"target_modules": ["q_proj", "lm_head"]}, r"target modules \['lm_head'\]"),
        "saved": ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    }
    for name, (fields, message) in cases.items():
        folder = copy(name)
        rewrite_config(folder, **fields)
        with pytest.raises(ValueError, match=message):
            manager.add(name, str(folder))
    broken = copy("broken")
    (broken / "adapter_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not readable JSON"):
        manager.add("broken", str(broken))
    torn = copy("torn")
    (torn / "adapter_model.safetensors").write_bytes(b"\x00" * 40)
    with pytest.raises(ValueError, match="not readable safetensors"):
        manager.add("torn", str(torn))
    half = copy("half")
    (half / "adapter_model.safetensors").unlink()
    with pytest.raises(ValueError, match=r"adapter_model\.safetensors is missing"):
        manager.add("half", str(half))
    with pytest.raises(ValueError, match="no such folder"):
        manager.add("gone", str(tmp_path / "gone"))
    with pytest.raises(ValueError, match="already loaded"):
        manager.add("twice", str(adapters["all"]))
        manager.add("twice", str(adapters["all"]))
    assert manager.names == ["twice"]


def test_an_adapter_of_another_base_model_is_refused(llama_case, tmp_path):
    base, _, _, _ = llama_case
    other = save_tiny_model(
        tiny_llama_config(hidden_size=96, intermediate_size=160), tmp_path / "m"
    )
    foreign = save_tiny_lora(other, tmp_path / "foreign", seed=4, rank=4)
    engine = build_engine(base, lora=LoraConfig(enable_lora=True))
    with pytest.raises(ValueError, match="an adapter of another base model"):
        engine.lora.add("foreign", str(foreign))
    moe = build_tiny_model("mixtral", tmp_path / "moe")
    with pytest.raises(ValueError, match="mixture of experts"):
        build_engine(moe, lora=LoraConfig(enable_lora=True))


def test_adapters_on_a_family_with_qkv_bias_and_qk_norms_equal_peft(tmp_path):
    for family in ("qwen2-bias", "qwen3-qknorm"):
        base = build_tiny_model(family, tmp_path / family)
        adapter = save_tiny_lora(base, tmp_path / f"{family}-lora", seed=7, rank=4)
        prompts = random_prompts(2, seed=11)
        engine = build_engine(base, lora=lora_config({"x": adapter}))
        batch, names = mixed_batch(prompts, ["x", None])
        got = engine.generate(batch, GREEDY, lora_names=names)
        want = {
            "x": peft_greedy(base, adapter, prompts, NEW_TOKENS),
            None: peft_greedy(base, None, prompts, NEW_TOKENS),
        }
        assert got == [want[n][prompts.index(p)] for p, n in zip(batch, names, strict=True)], family


def test_lora_modules_flag_forms(tmp_path):
    assert parse_lora_module("sql=/a/b") == LoraModule("sql", "/a/b")
    assert parse_lora_module(
        '{"name": "sql", "path": "/a/b", "base_model_name": "meta-llama/Llama-3.1-8B"}'
    ) == LoraModule("sql", "/a/b", "meta-llama/Llama-3.1-8B")
    for bad, message in [
        ("sql", "neither name=path nor JSON"),
        ("=/a", "adapter name"),
        ('{"name": "x"}', "needs name and path"),
        ('{"name": "x", "path": "/p", "rank": 3}', "unknown fields"),
        ("{oops", "not valid JSON"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse_lora_module(bad)
    with pytest.raises(ValueError, match="needs --enable-lora"):
        LoraConfig(modules={"x": "/p"}).validate()
    with pytest.raises(ValueError, match="not readable"):
        adapter_namespace("x", tmp_path)
