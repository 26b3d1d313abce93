"""Structured outputs, piece by piece: the request forms read into one spec, the spec's own
checks, each grammar library's matcher (masks, speculative rows rolled back, a trigger before
the grammar starts), the compiler's fallback and cache, the sampler's masks, and the one-process
engine's answers under a schema."""

from __future__ import annotations

import json
import math
import threading

import jsonschema
import pytest
import torch
from tiny_models import build_tiny_chat_model

from common.config import EngineConfig, SchedulerConfig
from common.engine.llm_engine import LLMEngine
from common.engine.sampler import Sampler, SamplingRow
from common.engine.structured.compiler import GrammarCompiler
from common.engine.structured.masks import fill_masks
from common.engine.structured.matcher import GrammarError
from common.engine.structured.state import GrammarState
from common.model.default_model import resolve_model_path
from common.sampling_params import SamplingParams
from common.structured import MAX_SPEC_BYTES, StructuredSpec
from common.tokenizer import Tokenizer
from router.errors import BadRequest
from router.structured_request import structured_spec

MODEL = resolve_model_path(None)
VOCAB = 49152
EOS = [2]
PERSON = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}


# -- the request forms --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "kind", "field"),
    [
        ({"response_format": {"type": "json_object"}}, "json_object", "response_format"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": PERSON}}},
            "json_schema",
            "response_format",
        ),
        ({"structured_outputs": {"json": PERSON}}, "json_schema", "structured_outputs"),
        ({"structured_outputs": {"regex": "[ab]+"}}, "regex", "structured_outputs"),
        ({"structured_outputs": {"choice": ["a", "b"]}}, "choice", "structured_outputs"),
        ({"structured_outputs": {"grammar": 'root ::= "a"'}}, "grammar", "structured_outputs"),
        ({"structured_outputs": {"json_object": True}}, "json_object", "structured_outputs"),
        ({"guided_json": json.dumps(PERSON)}, "json_schema", "guided_json"),
        ({"guided_json": PERSON}, "json_schema", "guided_json"),
        ({"guided_regex": "x"}, "regex", "guided_regex"),
        ({"guided_choice": ["a"]}, "choice", "guided_choice"),
        ({"guided_grammar": "start: /a+/"}, "grammar", "guided_grammar"),
    ],
)
def test_each_form_reads_into_one_spec(extra, kind, field):
    spec, named = structured_spec(extra)
    assert (spec.kind, named) == (kind, field)
    assert not spec.any_whitespace
    if kind == "json_schema":
        assert json.loads(spec.text) == PERSON


def test_text_and_nothing_ask_for_nothing():
    assert structured_spec({}) is None
    assert structured_spec({"response_format": {"type": "text"}, "guided_json": None}) is None


@pytest.mark.parametrize(
    ("extra", "field", "words"),
    [
        ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema.schema"),
        ({"response_format": {"type": "xml"}}, "response_format", "type must be"),
        ({"response_format": "json"}, "response_format", "an object with a type"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly"),
        ({"structured_outputs": {}}, "structured_outputs", "exactly one"),
        ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "structured_outputs",
         "whitespace_pattern is not supported"),
        ({"guided_json": "{not json"}, "guided_json", "not JSON"),
        ({"guided_choice": []}, "guided_choice", "non-empty list"),
        ({"guided_choice": "a"}, "guided_choice", "list of strings"),
        ({"guided_regex": ""}, "guided_regex", "must not be empty"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "one structured output"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex",
         "one structured output"),
        ({"response_format": {"type": "structural_tag"}}, "response_format", "or a format"),
        ({"response_format": {"type": "structural_tag", "triggers": ["<f>"], "structures": [
            {"begin": "<g>", "end": "</g>"}]}}, "response_format", "starts with no trigger"),
        ({"structured_outputs": {"structural_tag": '{"structures": [{"begin": "<f>"}], '
          '"triggers": ["<f>"]}'}}, "structured_outputs", "begin and end strings"),
    ],
)  # fmt: skip
def test_bad_forms_are_400s_naming_the_field(extra, field, words):
    with pytest.raises(BadRequest, match=words) as raised:
        structured_spec(extra)
    assert raised.value.param == field


def test_structured_outputs_options_shape_the_spec():
    open_schema = {"type": "object", "properties": {"a": {"type": "object"}}}
    spec, _ = structured_spec(
        {
            "structured_outputs": {
                "json": open_schema,
                "disable_any_whitespace": False,
                "disable_additional_properties": True,
                "backend": "auto",
            }
        }
    )
    assert spec.any_whitespace
    closed = json.loads(spec.text)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["a"]["additionalProperties"] is False


def test_a_spec_checks_itself():
    with pytest.raises(ValueError, match="kind must be one of"):
        StructuredSpec("yaml", "x")
    with pytest.raises(ValueError, match="bytes is more than"):
        StructuredSpec("regex", "a" * (MAX_SPEC_BYTES + 1))
    with pytest.raises(ValueError, match="starts_after"):
        StructuredSpec("regex", "a", starts_after=[-1])


# -- grammars and matchers ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(MODEL)


@pytest.fixture(scope="module")
def compiler():
    compiler = GrammarCompiler(MODEL, VOCAB, EOS)
    yield compiler
    compiler.close()


def allowed(bitmask: torch.Tensor, row: int) -> set[int]:
    bits = (bitmask[row, :, None] >> torch.arange(32, dtype=torch.int32)) & 1
    return set(torch.nonzero(bits.view(-1)[:VOCAB]).view(-1).tolist())


def started(compiler: GrammarCompiler, spec: StructuredSpec, output=()) -> GrammarState:
    state = GrammarState(spec, compiler.submit(spec))
    state.start(list(output))
    return state


def test_a_choice_allows_only_its_words_and_ends_with_them(compiler, tokenizer):
    spec = StructuredSpec("choice", json.dumps(["yes", "no"]))
    state = started(compiler, spec)
    bitmask = torch.zeros(1, VOCAB // 32, dtype=torch.int32)
    assert fill_masks([(state, [])], VOCAB) is not None
    state.fill_rows([], bitmask, 0)
    firsts = {tokenizer.encode(word, add_special_tokens=False)[0] for word in ("yes", "no")}
    assert firsts <= allowed(bitmask, 0)
    assert len(allowed(bitmask, 0)) < 50
    assert not state.advance(tokenizer.encode("yes", add_special_tokens=False)[0])
    with pytest.raises(GrammarError, match="breaks the choice"):
        state.advance(tokenizer.encode("maybe", add_special_tokens=False)[0])
    assert state.advance(EOS[0])  # the stop token: complete


@pytest.mark.parametrize("xgrammar_in_time", [True, False])
def test_speculative_rows_follow_the_proposals_and_leave_the_matcher_as_it_was(
    tokenizer, monkeypatch, xgrammar_in_time
):
    """Under each library: xgrammar, and llguidance where xgrammar is held past the timeout (a
    compile that waits on an event set only at the end: a timeout alone can lose the race to a
    fast compile)."""
    release = threading.Event()
    if not xgrammar_in_time:
        from common.engine.structured.xgrammar_backend import XGrammarBackend

        compile_spec = XGrammarBackend.compile

        def held(self, spec):
            release.wait(30)
            return compile_spec(self, spec)

        monkeypatch.setattr(XGrammarBackend, "compile", held)
    compiler = GrammarCompiler(MODEL, VOCAB, EOS, timeout_s=30.0 if xgrammar_in_time else 0.05)
    try:
        spec = StructuredSpec("regex", "[ab][0-9]{3}")
        state = started(compiler, spec)
        backend = compiler.submit(spec).result().backend.name
        assert backend == ("xgrammar" if xgrammar_in_time else "llguidance")
        a, seven, x, three = (
            tokenizer.encode(t, add_special_tokens=False)[0] for t in ("a", "7", "x", "3")
        )
        bitmask = torch.zeros(5, VOCAB // 32, dtype=torch.int32)
        # Rows 0-2: before each of the first three proposals; "x" is refused, so no more.
        assert state.fill_rows([a, seven, x, three], bitmask, 0) == [0, 1, 2]
        assert a in allowed(bitmask, 0) and seven in allowed(bitmask, 1)
        assert three in allowed(bitmask, 2) and x not in allowed(bitmask, 2)
        again = torch.zeros(1, VOCAB // 32, dtype=torch.int32)
        state.fill_rows([], again, 0)
        assert allowed(again, 0) == allowed(bitmask, 0)  # rolled back to where it was
    finally:
        release.set()
        compiler.close()


def test_a_trigger_keeps_the_grammar_off_until_the_output_holds_it(compiler, tokenizer):
    think_end = tokenizer.encode(" done.", add_special_tokens=False)
    spec = StructuredSpec("choice", json.dumps(["A", "B"]), starts_after=think_end)
    state = started(compiler, spec, output=tokenizer.encode("thinking", add_special_tokens=False))
    assert not state.active
    bitmask = torch.zeros(1, VOCAB // 32, dtype=torch.int32)
    assert state.fill_rows([], bitmask, 0) == []  # free text
    for token in think_end:
        state.advance(token)
    assert state.active
    assert state.fill_rows([], bitmask, 0) == [0]
    assert tokenizer.encode("A", add_special_tokens=False)[0] in allowed(bitmask, 0)


def test_a_structural_tag_leaves_text_free_until_its_trigger_then_holds_the_schema(
    compiler, tokenizer
):
    """vLLM's structural tag: free text, then after ``<f>`` the schema's JSON and ``</f>``."""
    tag = {
        "type": "structural_tag",
        "structures": [
            {
                "begin": "<f>",
                "schema": {
                    "type": "object",
                    "properties": {"n": {"type": "integer"}},
                    "required": ["n"],
                },
                "end": "</f>",
            }
        ],
        "triggers": ["<f>"],
    }
    state = started(compiler, StructuredSpec("structural_tag", json.dumps(tag)))
    bitmask = torch.zeros(1, VOCAB // 32, dtype=torch.int32)
    state.fill_rows([], bitmask, 0)
    word = tokenizer.encode("Hello", add_special_tokens=False)[0]
    assert word in allowed(bitmask, 0)  # before the trigger: text
    for token in tokenizer.encode("Hello <f>", add_special_tokens=False):
        assert not state.advance(token)
    state.fill_rows([], bitmask, 0)
    assert word not in allowed(bitmask, 0)  # inside: the schema's JSON only
    assert tokenizer.encode("{", add_special_tokens=False)[0] in allowed(bitmask, 0)
    for token in tokenizer.encode('{"n": 7}</f>', add_special_tokens=False):
        state.advance(token)
    state.fill_rows([], bitmask, 0)
    assert word in allowed(bitmask, 0)  # after the end tag: text again


def test_the_compiler_caches_by_text_and_fails_what_neither_library_compiles(compiler):
    spec = StructuredSpec("regex", "[0-9]+")
    first = compiler.submit(spec)
    assert compiler.submit(StructuredSpec("regex", "[0-9]+")) is first
    broken = compiler.submit(StructuredSpec("regex", "(a|b"))
    with pytest.raises(GrammarError, match="cannot be compiled"):
        broken.result()


# -- the sampler -----------------------------------------------------------------------------------


def test_the_sampler_takes_only_masked_in_tokens_and_reports_logprobs_under_the_mask():
    vocab = 64
    sampler = Sampler(vocab, [0])
    logits = torch.randn(3, vocab)
    logits[:, 40] = 50.0  # every row's favourite, masked out of the first
    bitmask = torch.zeros(3, 2, dtype=torch.int32)
    bitmask[0, 0] = (1 << 3) | (1 << 5)  # row 0: tokens 3 and 5 only
    from common.engine.structured.masks import GrammarMasks

    params = [
        SamplingParams(temperature=0.0, logprobs=1),
        SamplingParams(temperature=1.0, seed=1),
        SamplingParams(temperature=0.0),
    ]
    rows = [SamplingRow(p, [1, 2], 2) for p in params]
    out = sampler.sample(logits, rows, GrammarMasks(bitmask, [0]))
    assert out[0].token_id in (3, 5) and out[2].token_id == 40
    others = [lp for token, lp in out[0].top_logprobs or []]
    assert all(math.isfinite(lp) for lp in others)
    probs = torch.tensor([out[0].logprob]).exp()
    assert probs.item() > 0.0


# -- the one-process engine ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    folder = build_tiny_chat_model(tmp_path_factory.mktemp("structured") / "tiny-chat")
    engine = LLMEngine(
        EngineConfig(model=str(folder), dtype="float32", device="cpu",
                     scheduler=SchedulerConfig(max_model_len=256))
    )  # fmt: skip
    yield engine
    engine.close()


def test_sampled_answers_under_a_schema_are_valid_and_end_with_stop(engine, tokenizer):
    """A random model at temperature 1: whatever it would say, its answer is the schema's."""
    spec = StructuredSpec("json_schema", json.dumps(PERSON))
    prompt = tokenizer.encode("Give me JSON.")
    params = [
        SamplingParams(max_tokens=60, temperature=1.0, seed=seed, structured=spec)
        for seed in range(12)
    ]
    ids = [engine.add_request(prompt, p) for p in params]
    texts, reasons = {}, {}
    while engine.has_unfinished:
        for out in engine.step():
            texts.setdefault(out.request_id, []).extend(s.token_id for s in out.new_samples)
            if out.finished:
                reasons[out.request_id] = out.finish_reason.value
    for request_id in ids:
        answer = json.loads(tokenizer.decode(texts[request_id]))
        jsonschema.validate(answer, PERSON)
        assert reasons[request_id] == "stop"


def test_a_spec_no_library_compiles_fails_its_request_alone(engine, tokenizer):
    prompt = tokenizer.encode("Hi")
    bad = engine.add_request(
        prompt, SamplingParams(max_tokens=4, structured=StructuredSpec("regex", "(a|b"))
    )
    good = engine.add_request(prompt, SamplingParams(max_tokens=4, temperature=0.0))
    outputs = []
    while engine.has_unfinished:
        outputs += engine.step()
    [failed] = [out for out in outputs if out.request_id == bad]
    assert failed.finish_reason.value == "abort" and "cannot be compiled" in failed.error
    assert sum(len(out.new_samples) for out in outputs if out.request_id == good) == 4


def test_speculation_gives_the_same_answers_under_a_grammar(engine, tokenizer, tmp_path):
    """n-gram proposals are checked against the grammar (a refused one ends the verified run)
    and what is rejected never enters the matcher: greedy answers equal those without
    speculation, and valid."""
    from common import metrics
    from common.config import SpeculativeConfig

    flags = {"type": "array", "items": {"type": "boolean"}, "minItems": 24, "maxItems": 24}
    spec = StructuredSpec("json_schema", json.dumps(flags))
    prompts = [tokenizer.encode(f"Flags {i}:") for i in range(3)]
    params = SamplingParams(max_tokens=150, temperature=0.0, structured=spec)
    plain = engine.generate(prompts, params)
    speculating = LLMEngine(
        EngineConfig(
            model=str(engine.model_path), dtype="float32", device="cpu",
            scheduler=SchedulerConfig(max_model_len=256),
            speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=4),
        )
    )  # fmt: skip
    proposed = metrics.SPEC_PROPOSED._value.get()
    try:
        assert speculating.generate(prompts, params) == plain
    finally:
        speculating.close()
    assert metrics.SPEC_PROPOSED._value.get() > proposed  # it did propose
    for tokens in plain:
        jsonschema.validate(json.loads(tokenizer.decode(tokens)), flags)
