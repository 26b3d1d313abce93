"""Decode steps launched ahead (``--async-scheduling``): the engine launches the next step of the
same decodes before this one's tokens are read, and feeds it those tokens on the device.

On a CPU the forward runs as it is launched, so only the order of the host's work changes; these
tests turn it on there and check that every token, stop, abort, preemption and page is what the
steps taken one at a time give. The scheduler's part is checked alone first, with the tests
playing the runner (pages of 4 tokens, as in ``test_scheduler.py``).
"""

from __future__ import annotations

import pytest
from engines import build_engine
from test_scheduler import add, finish_step, make_scheduler, prompt, shape
from tiny_models import build_tiny_model, random_prompts

from common import metrics
from common.sampling_params import SamplingParams
from kernels.registry import ENV_VAR as BACKEND_ENV_VAR

GREEDY = SamplingParams(max_tokens=40, temperature=0.0)


class LaunchedAhead:
    """Steps launched ahead while the block runs."""

    def __enter__(self):
        self._start = metrics.STEPS_LAUNCHED_AHEAD._value.get()
        return self

    @property
    def count(self) -> int:
        return int(metrics.STEPS_LAUNCHED_AHEAD._value.get() - self._start)

    def __exit__(self, *exc):
        pass


# -- the scheduler alone -------------------------------------------------------------------------


def decoding(scheduler, *names_and_prompts):
    """Sequences admitted and prefilled in one step, each with its first token: all decoding."""
    seqs = [add(scheduler, name, tokens) for name, tokens in names_and_prompts]
    finish_step(scheduler, scheduler.schedule())
    return seqs


def test_the_step_ahead_is_the_same_rows_one_position_on_with_a_page_where_one_starts():
    scheduler = make_scheduler(budget=8)
    a, b = decoding(scheduler, ("a", prompt(10, 3)), ("b", prompt(20, 5)))
    # a: 4 tokens, 3 computed, its token goes to position 3, the ahead step's to 4: a new page.
    # b: 6 tokens, 5 computed: positions 5 and 6 both in its second page.
    batch = scheduler.schedule()
    assert shape(batch) == [("a", 1, True), ("b", 1, True)]
    free = scheduler.page_manager.num_free_pages
    ahead = scheduler.schedule_ahead(batch)
    assert ahead is not None and shape(ahead) == shape(batch)
    assert (len(a.page_ids), len(b.page_ids)) == (2, 2)
    assert scheduler.page_manager.num_free_pages == free - 1
    # Read in turn, the two steps give each sequence two tokens.
    finish_step(scheduler, batch, {"a": 50, "b": 60})
    finish_step(scheduler, ahead, {"a": 51, "b": 61})
    assert a.output_token_ids == [100, 50, 51] and b.output_token_ids == [100, 60, 61]
    assert (a.num_computed_tokens, b.num_computed_tokens) == (5, 7)


@pytest.mark.parametrize(
    "case",
    ["arrival waiting for a seat", "ends by max_tokens", "ends by the model's length", "no page"],
)
def test_no_step_ahead_where_the_next_step_is_not_known_before_the_tokens(case):
    knobs = {"ends by the model's length": {"max_model_len": 5}, "no page": {"num_pages": 1}}
    scheduler = make_scheduler(budget=8, **knobs.get(case, {}))
    max_tokens = 2 if case == "ends by max_tokens" else 16
    add(scheduler, "a", prompt(10, 3), max_tokens=max_tokens)
    finish_step(scheduler, scheduler.schedule())
    batch = scheduler.schedule()
    assert shape(batch) == [("a", 1, True)]
    if case == "arrival waiting for a seat":  # came after the step was launched
        add(scheduler, "b", prompt(20, 3))
    if case == "no page":  # the step ahead's position 4 would start a second page
        assert scheduler.page_manager.num_free_pages == 0
    assert scheduler.schedule_ahead(batch) is None


def test_a_row_stopped_before_its_step_ahead_is_dropped_and_its_pages_held_until_read():
    scheduler = make_scheduler(budget=8, num_pages=8)
    a, _ = decoding(scheduler, ("a", prompt(10, 3)), ("b", prompt(20, 3)))
    batch = scheduler.schedule()
    ahead = scheduler.schedule_ahead(batch)
    assert ahead is not None
    free = scheduler.page_manager.num_free_pages
    # a samples EOS: it leaves, but the step ahead still writes its slot in a's pages.
    outputs = finish_step(scheduler, batch, {"a": 2})
    assert [(o.seq.request_id, o.left_batch) for o in outputs] == [("a", True), ("b", False)]
    assert scheduler.page_manager.num_free_pages == free
    # Read, the step ahead yields b's token alone; nothing else is ahead, so a's pages are free.
    outputs = finish_step(scheduler, ahead, {"a": 70, "b": 71})
    assert [(o.seq.request_id, [s.token_id for s in o.new_samples]) for o in outputs] == [
        ("b", [71])
    ]
    assert a.output_token_ids == [100, 2]
    scheduler.release_held_pages()
    assert scheduler.page_manager.num_free_pages == free + 2
    assert scheduler.schedule_ahead(scheduler.schedule()) is not None  # b alone, steady again


# -- the engine ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_model("llama3-rope", tmp_path_factory.mktemp("model"))


def stopping_params(engine_kwargs, folder, prompts) -> list[SamplingParams]:
    """Every other prompt stops at a token of its own greedy run, the rest at a length of their
    own: rows leave the batch mid-run, each at another step."""
    free = build_engine(folder, **engine_kwargs).generate(prompts, GREEDY)
    return [
        SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=[free[i][4 + 3 * i]])
        if i % 2 == 0
        else SamplingParams(max_tokens=9 + 5 * i, temperature=0.0)
        for i in range(len(prompts))
    ]


@pytest.mark.parametrize(
    "dtype, deterministic", [("float32", False), ("bfloat16", False), ("bfloat16", True)]
)
def test_steps_launched_ahead_give_the_tokens_of_steps_taken_one_at_a_time(
    model, dtype, deterministic
):
    knobs = {"dtype": dtype, "deterministic": deterministic}
    prompts = random_prompts(8, seed=3)
    params = stopping_params(knobs, model, prompts)
    one_at_a_time = build_engine(model, **knobs)
    expected = one_at_a_time.generate(prompts, params)
    engine = build_engine(model, **knobs, async_scheduling=True)
    with LaunchedAhead() as launched:
        assert engine.generate(prompts, params) == expected
    assert launched.count > 20
    # No page was lost or is still held back.
    assert engine.page_manager.num_free_pages == one_at_a_time.page_manager.num_free_pages


def test_seeded_sampling_draws_the_same_tokens_launched_ahead(model):
    """A seeded row's noise depends on its (seed, step) alone, so a step launched ahead, which
    counts the token still on its way among the row's outputs, draws what the step taken alone
    would. Filters and biases are drawn on the device too; a row still short of min_tokens has
    its stop tokens banned from what it has sampled, so its steps wait for the tokens until
    then. Stop tokens end rows mid-run."""
    prompts = random_prompts(6, seed=7)
    base = {"max_tokens": 30, "temperature": 0.9}
    params = [
        SamplingParams(**base, seed=1),
        SamplingParams(**base, seed=2, top_k=20, top_p=0.9),
        SamplingParams(**base, seed=3, min_p=0.05, logit_bias={5: 3.0, 9: -2.0}),
        SamplingParams(**base, seed=4, min_tokens=12, stop_token_ids=[7, 11]),
        SamplingParams(**base | {"temperature": 0.0}, stop_token_ids=[3]),
        SamplingParams(**base, seed=6, top_k=5, stop_token_ids=[2, 4, 6, 8]),
    ]
    expected = build_engine(model).generate(prompts, params)
    engine = build_engine(model, async_scheduling=True)
    with LaunchedAhead() as launched:
        assert engine.generate(prompts, params) == expected
    assert launched.count > 10
    assert engine.page_manager.num_free_pages == 256


def test_the_default_is_on_with_cuda_alone(model):
    assert not build_engine(model).steps_ahead
    assert build_engine(model, async_scheduling=True).steps_ahead
    # A row that reads its history (penalties) or reports logprobs is read before the next
    # step is decided.
    engine = build_engine(model, async_scheduling=True)
    for params in (
        SamplingParams(max_tokens=8, seed=1, repetition_penalty=1.2),
        SamplingParams(max_tokens=8, temperature=0.0, logprobs=2),
    ):
        with LaunchedAhead() as launched:
            engine.generate(random_prompts(2, seed=4), params)
        assert launched.count == 0


def run_to_the_end(engine, tokens: dict[str, list[int]]) -> None:
    while engine.has_unfinished:
        add_outputs(engine.step(), tokens)


def add_outputs(outputs, tokens: dict[str, list[int]]) -> None:
    for output in outputs:
        tokens[output.request_id] += [s.token_id for s in output.new_samples]


def test_an_abort_while_the_step_ahead_is_in_flight(model):
    """The aborted request's row is dropped from the step ahead, its pages held until that step
    is read; the others go on as without steps ahead."""
    prompts = random_prompts(3, seed=5, min_len=20, max_len=30)
    runs = []
    for async_scheduling in (False, True):
        engine = build_engine(model, async_scheduling=async_scheduling)
        tokens = {f"r{i}": [] for i in range(len(prompts))}
        for request_id, p in zip(tokens, prompts, strict=True):
            engine.add_request(p, GREEDY, request_id)
        with LaunchedAhead() as launched:
            for _ in range(4):
                add_outputs(engine.step(), tokens)
        aborted = next(s for s in engine.scheduler.running if s.request_id == "r1")
        held, free = len(aborted.page_ids), engine.page_manager.num_free_pages
        assert engine.abort("r1")
        if async_scheduling:
            assert launched.count == 3  # each step after the first launched the next: in flight
            assert engine.page_manager.num_free_pages == free  # held for the step ahead
            outputs = engine.step()  # reads it: nothing for r1, and its pages come free
            assert sorted(o.request_id for o in outputs) == ["r0", "r2"]
            assert engine.page_manager.num_free_pages == free + held
            add_outputs(outputs, tokens)
        else:
            assert engine.page_manager.num_free_pages == free + held
        run_to_the_end(engine, tokens)
        runs.append(tokens)
    assert runs[1] == runs[0]


def test_a_request_arriving_while_a_step_is_ahead(model):
    prompts = random_prompts(4, seed=6)
    runs = []
    for async_scheduling in (False, True):
        engine = build_engine(model, async_scheduling=async_scheduling)
        tokens = {f"r{i}": [] for i in range(len(prompts))}
        for request_id, p in list(zip(tokens, prompts, strict=True))[:3]:
            engine.add_request(p, GREEDY, request_id)
        for _ in range(6):
            add_outputs(engine.step(), tokens)
        engine.add_request(prompts[3], GREEDY, "r3")
        run_to_the_end(engine, tokens)
        runs.append(tokens)
    assert runs[1] == runs[0]


def test_a_step_ahead_that_fails_to_launch_loses_no_token_or_page(model):
    """The launch of a step ahead raises (a device out of memory): the step before it was never
    read, so the next call schedules it again, and nothing is held back for it."""
    prompts = random_prompts(3, seed=8)
    expected = build_engine(model).generate(prompts, GREEDY)
    engine = build_engine(model, async_scheduling=True)
    launch = engine.runner.launch_decodes
    failures = []

    def failing_once(batch, after=None):
        if after is not None and not failures:
            failures.append(after)
            raise RuntimeError("out of memory")
        return launch(batch, after)

    engine.runner.launch_decodes = failing_once
    tokens = {f"r{i}": [] for i in range(len(prompts))}
    for request_id, p in zip(tokens, prompts, strict=True):
        engine.add_request(p, GREEDY, request_id)
    while engine.has_unfinished:
        try:
            add_outputs(engine.step(), tokens)
        except RuntimeError:
            assert failures
    assert failures  # the failure was met
    assert list(tokens.values()) == expected
    assert engine.page_manager.num_free_pages == 256


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_on_cuda_steps_launched_ahead_give_the_tokens_of_steps_one_at_a_time(
    tmp_path, monkeypatch, dtype
):
    """On a GPU, where a launch returns before the forward has run: CUDA graphs, the token ids
    fed on the device, read through the pinned buffers after the next step is launched. Every
    row stops by its length (known ahead; EOS ignored), so no row is dropped and each step of
    the two engines has the same rows: the same tokens bit for bit, greedy and seeded."""
    monkeypatch.setenv(BACKEND_ENV_VAR, "triton")
    folder = build_tiny_model("qwen3-qknorm", tmp_path / "model")
    prompts = random_prompts(6, seed=11, min_len=5, max_len=60)
    params = [
        SamplingParams(
            max_tokens=8 + 4 * i, temperature=0.0 if i % 2 else 0.8, seed=i, ignore_eos=True
        )
        for i in range(6)
    ]
    results = []
    for async_scheduling in (False, True):
        engine = build_engine(folder, device="cuda", dtype=dtype, num_pages=128,
                              max_num_seqs=6, max_model_len=256,
                              async_scheduling=async_scheduling)  # fmt: skip
        assert engine.steps_ahead == async_scheduling and engine.runner.graphs is not None
        with LaunchedAhead() as launched:
            results.append(engine.generate(prompts, params))
        assert (launched.count > 0) == async_scheduling
    assert results[1] == results[0]


def test_page_pressure_preempts_as_steps_taken_one_at_a_time_do(model):
    prompts = random_prompts(8, seed=12, min_len=30, max_len=60)
    params = SamplingParams(max_tokens=48, temperature=0.0)
    one_at_a_time = build_engine(model, num_pages=32)
    expected = one_at_a_time.generate(prompts, params)
    assert one_at_a_time.scheduler.num_preemptions > 0
    engine = build_engine(model, num_pages=32, async_scheduling=True)
    with LaunchedAhead() as launched:
        assert engine.generate(prompts, params) == expected
    assert launched.count > 0 and engine.scheduler.num_preemptions > 0
    assert engine.page_manager.num_free_pages == 32
