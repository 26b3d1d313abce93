"""`pdserve up`: a local cluster — the router plus N prefill and M decode workers — as processes.

Each service runs as its own process, exactly as docker-compose runs them (``python -m router``,
``python -m prefill_worker``, ``python -m decode_worker``). Flags this command does not know
are passed to every worker (engine flags such as ``--kv-cache-memory`` or ``--max-model-len``).
Without a GPU, the machine's cores are split between the workers and each worker's threads are
pinned to its share: two workers spinning on the same cores slow each other down many times over.
A prefill and a decode worker are paired, and each runs its forward on the other's share too
while the other has no work (``common/service/core_loan.py``).
With GPUs, each worker sees its own through CUDA_VISIBLE_DEVICES, one per tensor-parallel rank.
A worker that dies is started again; the router re-dispatches or migrates its requests meanwhile.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from common import cluster_auth
from common.service.core_loan import create_loan_file, omp_places
from common.service.drain import DEFAULT_DRAIN_TIMEOUT_S, positive_seconds
from kernels.cpu.features import has_amx_bf16
from planner.act import LocalWorkers
from planner.observe import RouterClient
from planner.service import add_planner_args, build_planner
from router.reasoning import reasoning_parser_names
from router.tool_parsers import tool_parser_names

# A worker that dies is started again (the router re-dispatches its requests meanwhile), at
# most this many times, so a worker that cannot start does not loop for ever.
MAX_RESTARTS = 5
CPU_LOCAL_PREFILL_OVERFLOW_TOKENS = 1024
# The same wait on a processor with AMX, where a bf16 prefill worker runs ~1,500 tokens/s a
# core: at 1024, W3's 1800-token prompts overflowed to the decode worker behind the previous
# one (still counted queued), which prefilled it 16 tokens a step beside its decodes: TTFT p99
# 5.6 s against a p50 of 1.3 s.
CPU_AMX_LOCAL_PREFILL_OVERFLOW_TOKENS = 4096
# Without a GPU a decode worker prefills prompts shorter than this itself: 16 prompt rows beside
# its decodes cost little (below), while a prefill worker's queue and 256-token steps (~0.45 s
# each) come first there. W3's short chats (64 tokens) beside long prompts on the AVX-512 Xeon:
# TTFT p50 729 ms and p99 1467 ms through the prefill worker, 253 and 965 ms prefilled locally.
CPU_REMOTE_PREFILL_MIN_TOKENS = 128
# A CPU decode worker prefilling an overflowed prompt in place computes at most this many prompt
# tokens a step beside its decodes: a 256-token chunk made every running sequence wait ~0.6 s
# for its next token (W1's ITL p99: 790 ms), a 64-token one ~0.18 s. A step of a few rows costs
# about what reading the weights costs, so 16 prompt rows beside 8 decodes add little to it:
# on the AVX-512 Xeon W1's ITL p99 was 182 ms at 64, 125 at 32, 73-85 at 16 and 94 at 8 (the
# prompt then stays on the decode worker for more steps), tok/s and TTFT within the noise.
CPU_DECODE_WORKER_PREFILL_TOKENS = 16


@dataclass(slots=True)
class Placement:
    """Where a worker's processes run: its cores (None: wherever the OS puts them) and its GPUs
    (None: every GPU the launcher sees), the first for rank 0, the next for rank 1, ..."""

    cores: set[int] | None = None
    gpus: list[str] | None = None
    # The paired worker's cores, which this one's forward may borrow while that one waits.
    lent: set[int] | None = None


@dataclass(slots=True)
class Service:
    name: str
    module: str
    args: list[str]
    placement: Placement
    process: subprocess.Popen
    restarts: int = 0

    def start_again(self) -> None:
        self.process = _start(self.module, self.args, self.placement)
        self.restarts += 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve up",
        description="Start the router and prefill/decode workers locally; Ctrl-C stops them.",
        epilog="Other flags (engine flags such as --kv-cache-memory) go to every worker.",
    )
    parser.add_argument("--model", default=None, help="model folder (default: SmolLM2)")
    parser.add_argument("--prefill", type=int, default=1, help="prefill workers")
    parser.add_argument("--decode", type=int, default=1, help="decode workers")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="the router's HTTP port")
    parser.add_argument("--control-port", type=int, default=None, help="default: --port + 1")
    parser.add_argument("--kv-transfer", default="zmq", choices=["zmq", "nixl"])
    parser.add_argument("--api-key", default=None)
    parser.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="the router's: names the API answers to (default: the model folder's name)",
    )
    parser.add_argument(
        "--remote-prefill-min-tokens",
        type=int,
        default=None,
        help=f"the router's: shorter prompts are prefilled by their decode worker (default: "
        f"{CPU_REMOTE_PREFILL_MIN_TOKENS} without a GPU, the router's 64 with one)",
    )
    parser.add_argument(
        "--local-prefill-overflow-tokens",
        type=int,
        default=None,
        help="the router's overflow threshold (default: 1024 without a GPU, off with one)",
    )
    parser.add_argument(
        "--prefix-fetch",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the router's: a prompt prefilled by its decode worker fetches the leading pages a "
        "prefill worker holds instead of computing them (default: on)",
    )
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument(
        "--enable-lora",
        action="store_true",
        help="the router's and every worker's: serve LoRA adapters (docs/lora.md)",
    )
    parser.add_argument(
        "--lora-modules",
        nargs="+",
        default=[],
        metavar="NAME=PATH",
        help="the router's and every worker's: adapters served from the start (name=path or "
        "vLLM's JSON form); --max-loras, --max-cpu-loras and --max-lora-rank go to the workers",
    )
    parser.add_argument(
        "--allow-runtime-lora-updating",
        action="store_true",
        help="the router's: serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter",
    )
    parser.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=None,
        help="the router's: seconds of silence before a worker is taken out (default 10)",
    )
    parser.add_argument(
        "--max-tokens-default",
        type=int,
        default=None,
        help="the router's: most tokens for a chat request without max_tokens (default: the "
        "rest of the context)",
    )
    parser.add_argument(
        "--request-stall-timeout",
        type=float,
        default=None,
        help="the router's: seconds a request may go without moving before it is sent again "
        "(default 120)",
    )
    parser.add_argument(
        "--max-queue-delay",
        type=float,
        default=None,
        help="the router's: refuse at once (429, Retry-After) a request predicted to wait longer "
        "than this many seconds before its work starts (default: off)",
    )
    parser.add_argument(
        "--max-inflight-per-worker",
        type=int,
        default=None,
        help="the router's: requests one worker may hold; the rest wait in the router's queue, "
        "lowest priority first (default: off)",
    )
    parser.add_argument(
        "--grammar-compile-timeout",
        type=float,
        default=None,
        help="the router's: seconds a structured output's grammar may take to compile in its "
        "check (default 10)",
    )
    parser.add_argument(
        "--max-request-tokens",
        type=int,
        default=None,
        help="the router's: most tokens one request may generate in all, n x prompts x "
        "max_tokens (default 1048576)",
    )
    parser.add_argument(
        "--slo-ttft-ms", type=float, default=None, help="the router's goodput TTFT objective"
    )
    parser.add_argument(
        "--slo-tpot-ms", type=float, default=None, help="the router's goodput TPOT objective"
    )
    parser.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="the router's: read tool calls from answers to tool_choice: auto (with "
        "--tool-call-parser)",
    )
    parser.add_argument(
        "--tool-call-parser",
        choices=tool_parser_names(),
        default=None,
        help="the router's: the format the model writes tool calls in",
    )
    parser.add_argument(
        "--reasoning-parser",
        choices=reasoning_parser_names(),
        default=None,
        help="the router's: split each chat answer's reasoning into `reasoning`",
    )
    # Flags of the workers of one role (the transfer ones go to every worker, which may switch
    # role); the rest of the unknown flags go to every worker.
    prefill = parser.add_argument_group("prefill workers")
    prefill.add_argument("--kv-lease-seconds", type=float, default=None)
    prefill.add_argument(
        "--prefill-tp",
        type=int,
        default=1,
        help="each prefill worker's --tensor-parallel-size (processes it splits the model over)",
    )
    prefill.add_argument("--ship-chunks", action=argparse.BooleanOptionalAction, default=None)
    prefill.add_argument(
        "--prefill-max-num-batched-tokens",
        type=int,
        default=None,
        help="each prefill worker's --max-num-batched-tokens (prompt tokens a step; default: "
        "2048 on a GPU, 1024 for a bf16 model on a CPU with AMX, else 256)",
    )
    decode = parser.add_argument_group("decode workers")
    decode.add_argument("--kv-fetch-timeout", type=float, default=None)
    decode.add_argument(
        "--decode-tp",
        type=int,
        default=1,
        help="each decode worker's --tensor-parallel-size (processes it splits the model over)",
    )
    decode.add_argument(
        "--max-prefill-tokens-while-decoding",
        type=int,
        default=None,
        help=f"prompt tokens a decode worker computes per step beside running decodes "
        f"(default: {CPU_DECODE_WORKER_PREFILL_TOKENS} without a GPU, the whole step with one)",
    )
    parser.add_argument(
        "--gpus",
        default=None,
        help="comma-separated GPUs for the workers, as CUDA_VISIBLE_DEVICES names them: each "
        "worker takes as many as its tensor-parallel size, in order, and the list is reused "
        "when it runs out (default: every GPU this process sees)",
    )
    parser.add_argument(
        "--pin-cores",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="pin each worker to its own cores (default: when there is no GPU)",
    )
    parser.add_argument(
        "--lend-idle-cores",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with pinned cores: pair each prefill worker with a decode worker, each running "
        "its forward on the other's cores too while the other has no work (workers of one "
        "rank)",
    )
    parser.add_argument(
        "--cluster-secret-file",
        default=None,
        help="the secret every process proves on the internal sockets (default: "
        "$PDSERVE_CLUSTER_SECRET, else a new one for this cluster)",
    )
    parser.add_argument(
        "--drain-timeout",
        type=positive_seconds,
        default=None,
        help=f"the workers': seconds from SIGTERM to exit, to finish what they hold (default "
        f"{DEFAULT_DRAIN_TIMEOUT_S:g}); stopping pdserve up drains the workers first",
    )
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument(
        "--planner",
        action="store_true",
        help="run the SLO planner beside the cluster: it switches workers' roles, and starts "
        "and stops workers up to --max-workers (docs/planner.md)",
    )
    parser.add_argument(
        "--max-workers",
        type=int,
        default=None,
        help="with --planner: the most workers it may run (default: --prefill + --decode, "
        "role switches alone)",
    )
    add_planner_args(parser, standalone=False)
    return parser


def tp_size(args: argparse.Namespace, role: str) -> int:
    """The tensor-parallel size of each worker of ``role``: the ranks it runs on."""
    return args.prefill_tp if role == "prefill" else args.decode_tp


def router_flags(args: argparse.Namespace) -> list[str]:
    """The flags given to ``pdserve up`` that tune the router, as the router takes them."""
    valued = (
        "heartbeat_timeout", "request_stall_timeout", "max_tokens_default", "slo_ttft_ms",
        "slo_tpot_ms", "max_queue_delay", "max_inflight_per_worker", "max_request_tokens",
        "grammar_compile_timeout", "tool_call_parser", "reasoning_parser",
    )  # fmt: skip
    flags: list[str] = []
    for name in valued:
        if getattr(args, name) is not None:
            flags += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    if args.enable_auto_tool_choice:
        flags.append("--enable-auto-tool-choice")
    if args.prefix_fetch is not None:
        flags.append("--prefix-fetch" if args.prefix_fetch else "--no-prefix-fetch")
    return flags


def role_flags(args: argparse.Namespace, role: str) -> list[str]:
    """The flags given to ``pdserve up`` that belong to workers starting as ``role``."""
    tp = tp_size(args, role)
    flags: list[str] = ["--tensor-parallel-size", str(tp)] if tp != 1 else []
    # The transfer flags of both roles go to every worker: any may switch role live and read
    # its new role's then. The engine's flags stay with the role a worker starts in.
    if args.kv_lease_seconds is not None:
        flags += ["--kv-lease-seconds", str(args.kv_lease_seconds)]
    if args.ship_chunks is not None:
        flags.append("--ship-chunks" if args.ship_chunks else "--no-ship-chunks")
    if args.kv_fetch_timeout is not None:
        flags += ["--kv-fetch-timeout", str(args.kv_fetch_timeout)]
    if role == "prefill":
        if args.prefill_max_num_batched_tokens is not None:
            flags += ["--max-num-batched-tokens", str(args.prefill_max_num_batched_tokens)]
    else:
        if args.max_prefill_tokens_while_decoding is not None:
            cap = args.max_prefill_tokens_while_decoding
            flags += ["--max-prefill-tokens-while-decoding", str(cap)]
    return flags


def worker_placements(args: argparse.Namespace, roles: list[str], on_gpu: bool) -> list[Placement]:
    """Each worker's cores and GPUs: on GPUs (or with ``--gpus``), GPUs of its own per rank as
    far as they go; without, cores of its own per rank (``--pin-cores``, the default there)."""
    sizes = [tp_size(args, role) for role in roles]
    pin = args.pin_cores if args.pin_cores is not None else not on_gpu
    cores = core_shares(sizes) if pin else [None] * len(roles)
    gpus: list[list[str] | None] = [None] * len(roles)
    if args.gpus is not None or on_gpu:
        listed = args.gpus.split(",") if args.gpus is not None else visible_gpus()
        listed = [gpu.strip() for gpu in listed if gpu.strip()]
        if not listed:
            raise ValueError("--gpus names no GPU")
        gpus = list(gpu_shares(sizes, listed))
    return [Placement(c, g) for c, g in zip(cores, gpus, strict=True)]


def pair_core_loans(
    roles: list[str], sizes: list[int], placements: list[Placement], directory: str
) -> list[list[str]]:
    """Pair prefill worker i with decode worker i (as far as both go), where both run on one
    rank and on cores of their own: each gets the other's cores as ``lent`` and a flags file
    they share in ``directory``. Returns each worker's flags (none for a worker left unpaired)."""
    flags: list[list[str]] = [[] for _ in roles]
    single = [index for index, size in enumerate(sizes) if size == 1]
    prefills = [index for index in single if roles[index] == "prefill"]
    decodes = [index for index in single if roles[index] == "decode"]
    for pair, (prefill, decode) in enumerate(zip(prefills, decodes, strict=False)):
        first, second = placements[prefill].cores, placements[decode].cores
        if not first or not second or first & second:
            continue
        path = os.path.join(directory, f"core-loan-{pair}")
        create_loan_file(path)
        for side, (worker, partner) in enumerate([(prefill, decode), (decode, prefill)]):
            lent = set(placements[partner].cores or ())
            placements[worker].lent = lent
            flags[worker] = ["--core-loan", path, "--core-loan-side", str(side)]
            flags[worker] += ["--lent-cores", str(len(lent))]
    return flags


def local_prefill_flags(args: argparse.Namespace, on_gpu: bool) -> list[str]:
    """The router's flags for which prompts a decode worker prefills itself, with the CPU
    defaults where the user gave none; sets the decode workers' cap on prompt tokens a step
    likewise."""
    overflow, remote_min = args.local_prefill_overflow_tokens, args.remote_prefill_min_tokens
    if not on_gpu:
        # A CPU prefill worker runs ~500 tokens/s a core: a prompt behind 1024 queued tokens
        # waits two seconds, longer than its decode worker takes to prefill it in place.
        if overflow is None:
            overflow = (
                CPU_AMX_LOCAL_PREFILL_OVERFLOW_TOKENS
                if has_amx_bf16()
                else CPU_LOCAL_PREFILL_OVERFLOW_TOKENS
            )
        remote_min = CPU_REMOTE_PREFILL_MIN_TOKENS if remote_min is None else remote_min
        if args.max_prefill_tokens_while_decoding is None:
            args.max_prefill_tokens_while_decoding = CPU_DECODE_WORKER_PREFILL_TOKENS
    flags = []
    if overflow is not None:
        flags += ["--local-prefill-overflow-tokens", str(overflow)]
    if remote_min is not None:
        flags += ["--remote-prefill-min-tokens", str(remote_min)]
    return flags


def core_shares(sizes: list[int]) -> list[set[int]]:
    """Split this process's cores among workers of ``sizes`` ranks each, disjoint and
    near-equal per rank, a worker taking its ranks' shares (its ranks then split them, see
    ``common/engine/tp_group.take_share_of_cores``). With fewer cores than ranks, per worker
    instead, its ranks sharing its cores (a rank spinning on another worker's core would slow
    that worker down many times over); with no more cores than workers, one core each,
    round-robin."""
    cores = sorted(os.sched_getaffinity(0))
    if sum(sizes) > len(cores):
        sizes = [1] * len(sizes)
    if len(sizes) >= len(cores):
        return [{cores[index % len(cores)]} for index in range(len(sizes))]
    ranks = sum(sizes)
    per_rank = [len(cores) // ranks + (rank < len(cores) % ranks) for rank in range(ranks)]
    shares: list[set[int]] = []
    start = rank = 0
    for size in sizes:
        count = sum(per_rank[rank : rank + size])
        shares.append(set(cores[start : start + count]))
        start, rank = start + count, rank + size
    return shares


def gpu_shares(sizes: list[int], gpus: list[str]) -> list[list[str]]:
    """Each worker's GPUs, one per rank: the next ``size`` of ``gpus`` in order, going round the
    list again when the ranks outnumber them (workers then share GPUs, as they do on one GPU);
    a worker's own ranks never share one."""
    shares: list[list[str]] = []
    first = 0
    for size in sizes:
        if size > len(gpus):
            raise ValueError(
                f"a worker of tensor-parallel size {size} needs {size} GPUs, and only "
                f"{len(gpus)} are given ({','.join(gpus)})"
            )
        shares.append([gpus[(first + rank) % len(gpus)] for rank in range(size)])
        first += size
    return shares


def gpu_available() -> bool:
    """``torch.cuda.is_available()`` as the workers' torch will answer it, without importing
    torch where its build has no GPU backend: the import is seconds of every start on a small
    CPU box, before anything else can start."""
    if not torch_build_has_gpu_backend():
        return False
    import torch

    return torch.cuda.is_available()


def torch_build_has_gpu_backend() -> bool:
    """Whether the installed torch was built for CUDA or ROCm, from its ``torch/version.py``
    (read, not imported). True where that cannot be told, so that torch is asked."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return True
    path = Path(next(iter(spec.submodule_search_locations))) / "version.py"
    try:
        return names_a_gpu_backend(path.read_text())
    except (OSError, ValueError):
        return True


def names_a_gpu_backend(version_py: str) -> bool:
    """Whether torch's ``version.py`` names a CUDA or ROCm version (``cuda: Optional[str] =
    None`` in a CPU build); True where it does not say either way."""
    versions = dict(re.findall(r"^(cuda|hip)\b[^=\n]*=\s*(.*?)\s*$", version_py, re.MULTILINE))
    if set(versions) != {"cuda", "hip"}:
        return True
    return any(version != "None" for version in versions.values())


class LocalLauncher:
    """The planner's ``WorkerLauncher`` (planner/act.py) over this launcher's processes: a
    worker started with the flags every worker got, on any core (the cores were shared out at
    start), and one stopped by SIGTERM (it drains) and no longer restarted."""

    def __init__(
        self,
        services: list[Service],
        lock: threading.Lock,
        shared: list[str],
        worker_flags: list[str],
        args: argparse.Namespace,
        first_index: int,
    ) -> None:
        self.services = services
        self.lock = lock
        self.shared = shared
        self.worker_flags = worker_flags
        self.args = args
        self.next_index = first_index

    def start(self, role: str) -> str:
        with self.lock:
            index = self.next_index
            self.next_index += 1
            worker_id = f"{role}-{index}"
            flags = [*self.shared, "--worker-id", worker_id, *role_flags(self.args, role)]
            name = f"{role} worker {index}"
            self.services.append(
                _spawn(name, f"{role}_worker", [*flags, *self.worker_flags], Placement())
            )
        return worker_id

    def stop(self, worker_id: str) -> None:
        with self.lock:
            for service in self.services:
                flags = service.args
                named = flags[flags.index("--worker-id") + 1] if "--worker-id" in flags else None
                if service.module != "router" and named == worker_id:
                    self.services.remove(service)
                    _terminate_later(service, self.args.drain_timeout or DEFAULT_DRAIN_TIMEOUT_S)
                    return
        raise ValueError(f"no worker {worker_id} was started here")


def _terminate_later(service: Service, drain_timeout: float) -> None:
    """SIGTERM ``service`` (it drains) and reap it in the background."""
    threading.Thread(target=_terminate, args=([service], drain_timeout + 5.0), daemon=True).start()


def start_planner(
    args: argparse.Namespace, base_url: str, launcher: LocalLauncher, stop: threading.Event
) -> threading.Thread:
    """The planner in a thread of this process, with a local actuator where --max-workers lets
    it start workers (``ValueError`` for bad planner flags)."""
    current = args.prefill + args.decode
    max_workers = args.max_workers if args.max_workers is not None else current
    if max_workers < current:
        raise ValueError(f"--max-workers {max_workers} is below the {current} workers started")
    scaler = LocalWorkers(launcher) if max_workers > current else None
    planner = build_planner(args, RouterClient(base_url, args.api_key), scaler, max_workers)
    thread = threading.Thread(
        target=planner.run, args=(args.planner_interval, stop), name="planner", daemon=True
    )
    thread.start()
    return thread


def visible_gpus() -> list[str]:
    """The GPUs this process sees, as CUDA_VISIBLE_DEVICES would name them to a child."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [gpu.strip() for gpu in listed.split(",") if gpu.strip()]
    import torch

    return [str(index) for index in range(torch.cuda.device_count())]


def worker_env(placement: Placement) -> dict[str, str]:
    env = dict(os.environ)
    if placement.cores is not None:
        env["OMP_NUM_THREADS"] = str(len(placement.cores))
        if placement.lent:
            # Its first threads on its own cores, any more on the lent ones.
            env["OMP_PLACES"] = omp_places(placement.cores, placement.lent)
            env["OMP_PROC_BIND"] = "close"
    if placement.gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(placement.gpus)
    return env


def _start(module: str, args: list[str], placement: Placement) -> subprocess.Popen:
    cores = placement.cores
    preexec = None
    if cores is not None:
        # OpenMP then binds each thread to one of them (worker_env's places).
        cores = cores | (placement.lent or set())
        preexec = lambda: os.sched_setaffinity(0, cores)  # noqa: E731 - runs in the child
    return subprocess.Popen(
        [sys.executable, "-m", module, *args], env=worker_env(placement), preexec_fn=preexec
    )


def _spawn(name: str, module: str, args: list[str], placement: Placement) -> Service:
    return Service(name, module, args, placement, _start(module, args, placement))


def supervise(services: list[Service]) -> str | None:
    """Restart workers that died; returns why the cluster must stop, or None."""
    for service in services:
        code = service.process.poll()
        if code is None:
            continue
        if service.module == "router":
            return f"the router exited with code {code}"
        if service.restarts >= MAX_RESTARTS:
            return f"{service.name} exited with code {code} after {MAX_RESTARTS} restarts"
        print(f"pdserve up: {service.name} exited with code {code}; starting it again",
              file=sys.stderr, flush=True)  # fmt: skip
        service.start_again()
    return None


def _get_json(url: str, api_key: str | None) -> dict | None:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=2) as r:
            return json.loads(r.read())
    except (urllib.error.URLError, OSError, ValueError):
        return None


def _count_workers(listing: dict) -> dict[str, int]:
    return {role: len(listing.get(role, [])) for role in ("prefill", "decode")}


def wait_until_ready(services: list[Service], base_url: str, args) -> None:
    deadline = time.monotonic() + args.startup_timeout
    wanted = {"prefill": args.prefill, "decode": args.decode}
    while time.monotonic() < deadline:
        for service in services:
            if service.process.poll() is not None:
                raise RuntimeError(f"{service.name} exited with code {service.process.returncode}")
        listing = _get_json(f"{base_url}/v1/workers", args.api_key)
        if listing is not None and _count_workers(listing) == wanted:
            return
        time.sleep(0.5)
    raise RuntimeError(f"the cluster was not ready within {args.startup_timeout:.0f} s")


def stop_all(services: list[Service], drain_timeout: float = DEFAULT_DRAIN_TIMEOUT_S) -> None:
    """SIGTERM the workers, which drain (they finish what they hold, telling the router), then
    the router; whatever is still running after its time is killed."""
    workers = [s for s in services if s.module != "router"]
    routers = [s for s in services if s.module == "router"]
    _terminate(workers, grace=drain_timeout + 5.0)
    _terminate(routers, grace=15.0)


def _terminate(services: list[Service], grace: float) -> None:
    for service in services:
        if service.process.poll() is None:
            service.process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for service in services:
        try:
            service.process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            service.process.kill()
            service.process.wait()


def main(argv: list[str] | None = None) -> int:
    args, worker_flags = build_parser().parse_known_args(argv)
    if args.prefill < 0 or args.decode < 1:
        print("pdserve up: needs --decode >= 1 and --prefill >= 0", file=sys.stderr)
        return 2
    if args.prefill_tp < 1 or args.decode_tp < 1:
        print("pdserve up: --prefill-tp and --decode-tp must be >= 1", file=sys.stderr)
        return 2
    if args.planner and (args.slo_ttft_ms is None or args.slo_itl_ms is None):
        print("pdserve up: --planner needs --slo-ttft-ms and --slo-itl-ms", file=sys.stderr)
        return 2
    from common.model.default_model import resolve_model_path

    try:
        model = str(resolve_model_path(args.model))  # convert the default model once, here
    except (ValueError, ModuleNotFoundError) as exc:
        print(f"pdserve up: {exc}", file=sys.stderr)
        return 2
    if args.cluster_secret_file:
        secret_flags = ["--cluster-secret-file", args.cluster_secret_file]
    else:
        secret_flags = []
        # Every process started from here inherits it: the cluster's sockets admit no one else.
        os.environ.setdefault(cluster_auth.SECRET_ENV, secrets.token_urlsafe(32))
    try:
        cluster_auth.load_secret(args.cluster_secret_file)
    except ValueError as exc:
        print(f"pdserve up: {exc}", file=sys.stderr)
        return 2
    control = f"tcp://{args.host}:{args.control_port or args.port + 1}"
    base_url = f"http://{args.host}:{args.port}"
    router_args = [
        "--host",
        args.host,
        "--port",
        str(args.port),
        "--control",
        control,
        "--model",
        model,
        "--log-level",
        args.log_level.lower(),
        *secret_flags,
    ]
    if args.api_key:
        router_args += ["--api-key", args.api_key]
    if args.served_model_name:
        router_args += ["--served-model-name", *args.served_model_name]
    router_args += router_flags(args)
    on_gpu = gpu_available()
    router_args += local_prefill_flags(args, on_gpu)
    shared = [
        "--router",
        control,
        "--model",
        model,
        "--host",
        args.host,
        "--kv-transfer",
        args.kv_transfer,
        "--log-level",
        args.log_level,
        *secret_flags,
    ]
    if args.drain_timeout is not None:
        shared += ["--drain-timeout", str(args.drain_timeout)]
    if args.max_model_len is not None:
        router_args += ["--max-model-len", str(args.max_model_len)]
        shared += ["--max-model-len", str(args.max_model_len)]
    if args.enable_lora:
        lora = ["--enable-lora"] + (
            ["--lora-modules", *args.lora_modules] if args.lora_modules else []
        )
        router_args += lora
        shared += lora
    if args.allow_runtime_lora_updating:
        router_args.append("--allow-runtime-lora-updating")
    roles = ["prefill"] * args.prefill + ["decode"] * args.decode
    try:
        placements = worker_placements(args, roles, on_gpu)
    except ValueError as exc:
        print(f"pdserve up: {exc}", file=sys.stderr)
        return 2
    loans_dir = tempfile.mkdtemp(prefix="pdserve-core-loans-")
    sizes = [tp_size(args, role) for role in roles]
    loan_flags = (
        pair_core_loans(roles, sizes, placements, loans_dir)
        if args.lend_idle_cores
        else [[] for _ in roles]
    )
    services: list[Service] = []
    lock = threading.Lock()  # the services list: the supervisor's and the planner's
    planner_stop = threading.Event()
    planner_thread: threading.Thread | None = None
    stopping = False

    def request_stop(*_):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    try:
        services.append(_spawn("router", "router", router_args, Placement()))
        workers = zip(roles, placements, loan_flags, strict=True)
        for index, (role, placement, loans) in enumerate(workers):
            worker_id = ["--worker-id", f"{role}-{index}"]
            services.append(
                _spawn(
                    f"{role} worker {index}",
                    f"{role}_worker",
                    [*shared, *worker_id, *role_flags(args, role), *loans, *worker_flags],
                    placement,
                )
            )
        wait_until_ready(services, base_url, args)
        if args.planner:
            starter = LocalLauncher(services, lock, shared, worker_flags, args, len(roles))
            planner_thread = start_planner(args, base_url, starter, planner_stop)
        print(
            f"pdserve is up: {base_url}/v1 ({args.prefill} prefill, {args.decode} decode, "
            f"model {os.path.basename(model)}). Ctrl-C stops it.",
            flush=True,
        )
        while not stopping:
            with lock:
                problem = supervise(services)
            if problem is not None:
                print(f"pdserve up: {problem}; stopping", file=sys.stderr)
                return 1
            time.sleep(0.5)
        return 0
    except (RuntimeError, ValueError) as exc:
        print(f"pdserve up: {exc}", file=sys.stderr)
        return 1
    finally:
        planner_stop.set()
        if planner_thread is not None:
            planner_thread.join(timeout=30)
        stop_all(services, args.drain_timeout or DEFAULT_DRAIN_TIMEOUT_S)
        shutil.rmtree(loans_dir, ignore_errors=True)
