"""The planner against every fixed split, on a trace that changes under it.

    python -m benchmarks.planner [--quick] [--cost-model benchmarks/cost_models/....json]

One `pdserve up` of 8 simulated workers (``--simulated-engine``: the real router, workers,
scheduler and wire, each step sleeping for the cost model's time) serves a trace in three
phases, Poisson arrivals of a fixed seed:

1. prompt-heavy: long prompts (a full prefill step each), answers of 4 tokens;
2. generation-heavy: 16-token prompts, answers of 96;
3. a burst: phase 2's requests at three times its rate, for a third of its time.

The phases are sized from the cost model (``phases``), so that each one wants another split:
phase 1 asks 4.5 prefill workers' worth of prompt tokens, phase 2 4.5 decode workers' worth of
rows at the ITL objective, phase 3 three times that. The modelled device runs ``--slowdown``
(4) times slower than the cost model says, its SLOs as much looser: the box's own work for each
token (the router's, the workers' loops) then weighs a quarter as much beside the sleeps. The
trace is replayed once at every fixed split from 1:7 to 7:1 (set by role switches between runs,
nothing running) and once with the planner, started at 4:4, acting by role switches. A
request meets the SLOs when its TTFT and its mean inter-token time (the router's own figures,
``GET /v1/traffic``) are within ``--slo-ttft-ms`` and ``--slo-itl-ms``; a request that failed
meets nothing, nor one the client gave up on once it could no longer meet them (the router
aborts it). The workers keep no prefix cache: every run replays the same prompts.

Prints, for each run, ``split P:D attainment X%`` or ``planner attainment X%
switches N flaps F`` (a flap: a change reversing one made at most two intervals before), each
phase's attainment beside it, and the box.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import subprocess
import threading
import time
import urllib.request
from argparse import Namespace
from dataclasses import dataclass
from pathlib import Path

import httpx

from benchmarks.harness import pdserve_up
from common.cost_model import CostModel
from planner.decide import count_flaps
from planner.observe import RouterClient
from planner.service import build_planner

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_COST_MODEL = ROOT / "benchmarks/cost_models/cpu-smollm2-135m.json"
NUM_WORKERS = 8


@dataclass(frozen=True, slots=True)
class Phase:
    name: str
    seconds: float
    rate: float  # requests per second
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True, slots=True)
class Request:
    at: float  # seconds from the trace's start
    phase: int
    prompt: list[int]
    max_tokens: int


def box() -> str:
    flags = subprocess.run(
        "grep -o 'avx512[a-z_0-9]*' /proc/cpuinfo | sort -u",
        shell=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    return " ".join(flags) or "no AVX-512"


def phases(cost: CostModel, slo_itl_s: float, seconds: float) -> list[Phase]:
    """The trace's phases, sized from ``cost``. Phase 1 asks 4.5 prefill workers' worth of
    prompt tokens (at 4 of them prefill falls behind; 6 carry it at 0.75), in prompts of one
    step each. Phase 2 asks 4.5 decode workers' worth of rows at the ITL objective, and little
    of prefill. Phase 3 is phase 2 at three times the rate, for a third of the time: no split
    carries it all."""
    budget = cost.max_num_batched_tokens or 256
    long_prompt, short_answer = budget, 4
    # Prompt tokens a prefill worker computes per second in full steps.
    prefill_rate = budget / cost.step_seconds(budget, 1, budget)
    heavy_rate = 4.5 * prefill_rate / long_prompt
    short_prompt, long_answer = 16, 96
    # Rows a decode worker steps within 0.8 of the ITL objective.
    step_s = 0.8 * slo_itl_s
    context = short_prompt + long_answer / 2
    per_row = cost.per_token_s + cost.per_seq_s + cost.per_context_token_s * context
    rows = max(1.0, (step_s - cost.fixed_s) / per_row)
    chat_rate = 4.5 * rows / (long_answer * step_s)
    return [
        Phase("prompt-heavy", seconds, heavy_rate, long_prompt, short_answer),
        Phase("generation-heavy", seconds, chat_rate, short_prompt, long_answer),
        Phase("burst", seconds / 3, 3 * chat_rate, short_prompt, long_answer),
    ]


def trace(plan: list[Phase], seed: int = 0) -> list[Request]:
    rng = random.Random(seed)
    requests: list[Request] = []
    start = 0.0
    for index, phase in enumerate(plan):
        at = start + rng.expovariate(phase.rate)
        while at < start + phase.seconds:
            length = max(8, int(phase.prompt_tokens * rng.uniform(0.8, 1.2)))
            # A prompt of its own (no prefix shared with another): every token is computed.
            prompt = [10 + (len(requests) * 7919 + i * 31) % 40000 for i in range(length)]
            requests.append(Request(at, index, prompt, phase.output_tokens))
            at += rng.expovariate(phase.rate)
        start += phase.seconds
    return requests


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.loads(response.read())


def set_split(base: str, prefill: int) -> None:
    """Switch workers until ``prefill`` of them serve prefill, one switch at a time."""
    client = RouterClient(base, timeout=120)
    for _ in range(2 * NUM_WORKERS):
        listing = get_json(f"{base}/v1/workers")
        have = len(listing["prefill"])
        if have == prefill and len(listing["decode"]) == NUM_WORKERS - prefill:
            return
        donor, role = ("decode", "prefill") if have < prefill else ("prefill", "decode")
        worker = listing[donor][0]["id"]
        status, body = client.post(f"/v1/workers/{worker}/role", {"role": role, "wait": True})
        if status != 200:
            raise RuntimeError(f"switching {worker} to {role}: HTTP {status} {body}")
    raise RuntimeError(f"the split did not reach {prefill}:{NUM_WORKERS - prefill}")


async def replay(
    base: str, model: str, requests: list[Request], slo_ttft_s: float, slo_itl_s: float
) -> list[bool]:
    """Send every request at its time; whether each was answered in full. A request still
    unanswered when it could no longer meet both SLOs (its TTFT objective plus the ITL
    objective for each later token) is given up, as a client would: the router then aborts it
    on its workers, and a split that fell behind does not carry its whole backlog on."""
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
    async with httpx.AsyncClient(base_url=base, limits=limits) as http:
        began = time.monotonic()

        async def send(request: Request) -> bool:
            await asyncio.sleep(max(0.0, request.at - (time.monotonic() - began)))
            body = {
                "model": model,
                "prompt": request.prompt,
                "max_tokens": request.max_tokens,
                "temperature": 0.0,
            }
            hopeless_after = slo_ttft_s + (request.max_tokens - 1) * slo_itl_s + 1.0
            try:
                response = await http.post("/v1/completions", json=body, timeout=hopeless_after)
            except httpx.HTTPError:
                return False
            return response.status_code == 200

        return list(await asyncio.gather(*(send(r) for r in requests)))


def wait_idle(base: str, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while (
        "pdserve_router_inflight_requests 0.0"
        not in urllib.request.urlopen(f"{base}/metrics", timeout=30).read().decode()
    ):
        if time.monotonic() > deadline:
            raise RuntimeError("requests still in flight")
        time.sleep(0.5)


def run_trace(
    base: str, model: str, requests: list[Request], slo_ttft_s: float, slo_itl_s: float
) -> tuple[float, list[float]]:
    """Replay ``requests``; the share meeting both SLOs, overall and per phase."""
    wait_idle(base)
    started = time.monotonic()
    answered = asyncio.run(replay(base, model, requests, slo_ttft_s, slo_itl_s))
    wait_idle(base)
    window = min(600.0, time.monotonic() - started + 1)
    finished = get_json(f"{base}/v1/traffic?window_s={window:.0f}")["finished"]
    # The router's entries of this run, oldest first, matched to the requests by prompt length
    # and output (each prompt's length is drawn apart; ties are within a phase alike).
    met_by_key: dict[tuple[int, int], list[bool]] = {}
    for entry in sorted(finished, key=lambda f: -f["age_s"]):
        ok = entry["ttft_s"] <= slo_ttft_s and entry["tpot_s"] <= slo_itl_s
        met_by_key.setdefault((entry["prompt_tokens"], entry["output_tokens"]), []).append(ok)
    met = []
    for request, whole in zip(requests, answered, strict=True):
        outcomes = met_by_key.get((len(request.prompt), request.max_tokens), [])
        met.append(whole and bool(outcomes) and outcomes.pop(0))
    phases_met = []
    for index in sorted({r.phase for r in requests}):
        mine = [m for m, r in zip(met, requests, strict=True) if r.phase == index]
        phases_met.append(sum(mine) / max(1, len(mine)))
    return sum(met) / len(met), phases_met


def planner_args(args: argparse.Namespace, cost_model: Path) -> Namespace:
    return Namespace(
        slo_ttft_ms=args.slo_ttft_ms,
        slo_itl_ms=args.slo_itl_ms,
        planner_interval=args.interval,
        planner_window=args.window,
        min_prefill=1,
        min_decode=1,
        planner_margin=0.03,
        cost_model=str(cost_model),
        role_switch=True,
        planner_max_pending=args.max_pending,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short phases, splits 1:7, 4:4, 7:1")
    parser.add_argument("--cost-model", type=Path, default=DEFAULT_COST_MODEL)
    parser.add_argument(
        "--slowdown",
        type=float,
        default=4.0,
        help="run the modelled device this many times slower (its steps and the SLOs alike), "
        "so that a small box carries the workers' and the router's own work beside the sleeps",
    )
    parser.add_argument("--phase-seconds", type=float, default=None)
    parser.add_argument("--slo-ttft-ms", type=float, default=None)
    parser.add_argument("--slo-itl-ms", type=float, default=None)
    parser.add_argument("--interval", type=float, default=2.0, help="the planner's interval")
    parser.add_argument("--window", type=float, default=10.0, help="the planner's window")
    parser.add_argument(
        "--max-pending", type=int, default=2, help="the planner's changes in flight at once"
    )
    parser.add_argument("--model", default=None, help="whose tokenizer and config (default)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    base_cost = CostModel.load(args.cost_model)
    k = args.slowdown
    cost = CostModel(
        **{
            **base_cost.to_json(),
            "fixed_s": base_cost.fixed_s * k,
            "per_token_s": base_cost.per_token_s * k,
            "per_seq_s": base_cost.per_seq_s * k,
            "per_context_token_s": base_cost.per_context_token_s * k,
        }
    )
    budget = cost.max_num_batched_tokens or 256
    # SLOs from the device: a full prefill step's time three times over, and a decode step of
    # a few dozen rows.
    if args.slo_ttft_ms is None:
        args.slo_ttft_ms = 3e3 * cost.step_seconds(budget, 1, budget)
    if args.slo_itl_ms is None:
        args.slo_itl_ms = 1e3 * (cost.fixed_s + 40 * (cost.per_token_s + cost.per_seq_s))
    slo_ttft_s, slo_itl_s = args.slo_ttft_ms / 1e3, args.slo_itl_ms / 1e3
    seconds = args.phase_seconds or (45.0 if args.quick else 75.0)
    plan = phases(cost, slo_itl_s, seconds)
    requests = trace(plan, args.seed)
    splits = [1, 4, 7] if args.quick else list(range(1, NUM_WORKERS))
    scaled = Path(f"/tmp/pdserve-planner-cost-{time.monotonic_ns()}.json")
    scaled.write_text(json.dumps(cost.to_json()))
    print(f"box: {box()}")
    print(f"cost model: {args.cost_model.name} x{k:g} ({cost.source})")
    print(
        f"SLOs: TTFT {args.slo_ttft_ms:.0f} ms, ITL {args.slo_itl_ms:.0f} ms; "
        f"{len(requests)} requests"
    )
    for phase in plan:
        print(
            f"phase {phase.name}: {phase.seconds:.0f} s at {phase.rate:.2f} req/s, prompts "
            f"~{phase.prompt_tokens} tokens, answers {phase.output_tokens}"
        )
    flags = (
        "--prefill", "4", "--decode", "4", "--simulated-engine", str(scaled),
        "--remote-prefill-min-tokens", "1", "--local-prefill-overflow-tokens", "100000000",
        "--max-model-len", "4096", "--no-pin-cores", "--max-num-seqs", "512",
        # Every run replays the same prompts: a prefix cache would serve the later runs theirs.
        "--no-enable-prefix-caching",
    )  # fmt: skip
    results: dict[str, float] = {}
    try:
        with pdserve_up(args.model, *flags, startup_timeout=900) as cluster:
            base = cluster.base_url
            model = get_json(f"{base}/v1/models")["data"][0]["id"]
            for prefill in splits:
                set_split(base, prefill)
                overall, per_phase = run_trace(base, model, requests, slo_ttft_s, slo_itl_s)
                results[f"{prefill}:{NUM_WORKERS - prefill}"] = overall
                print(
                    f"split {prefill}:{NUM_WORKERS - prefill} attainment {overall:.1%} "
                    f"(phases {' / '.join(f'{p:.0%}' for p in per_phase)})",
                    flush=True,
                )
            set_split(base, NUM_WORKERS // 2)
            planner = build_planner(planner_args(args, scaled), RouterClient(base))
            stop = threading.Event()
            thread = threading.Thread(target=planner.run, args=(args.interval, stop), daemon=True)
            thread.start()
            try:
                overall, per_phase = run_trace(base, model, requests, slo_ttft_s, slo_itl_s)
            finally:
                stop.set()
                thread.join(timeout=60)
            changes = [(c.interval, c.change) for c in planner.changes]
            print(
                f"planner attainment {overall:.1%} switches {len(changes)} flaps "
                f"{count_flaps(changes)} (phases {' / '.join(f'{p:.0%}' for p in per_phase)})",
                flush=True,
            )
            for logged in planner.changes:
                print(f"  interval {logged.interval}: {logged.what}")
            best = max(results.values())
            gain = overall - best
            print(f"planner - best fixed split: {gain * 100:+.1f} points")
    finally:
        scaled.unlink(missing_ok=True)
    return 0 if math.isfinite(best) else 1


if __name__ == "__main__":
    raise SystemExit(main())
