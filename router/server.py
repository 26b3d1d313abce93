"""`pdserve router`: the command line, the model's tokenizer, and uvicorn."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from common.cluster_auth import add_insecure_flag, secret_for_binding
from common.lora_adapters import LoraModule, adapter_namespace, parse_lora_module
from common.startup_objects import startup_objects_frozen
from router.admission import AdmissionConfig
from router.app import create_app
from router.config import OutputParsing, RouterAdapter, RouterConfig
from router.http_protocol import with_read_deadline
from router.policy import DISK_HIT_WEIGHT, HOST_HIT_WEIGHT, RoutingConfig
from router.reasoning import reasoning_parser_names
from router.request_metrics import ServiceLevel
from router.tool_parsers import tool_parser_names

if TYPE_CHECKING:
    # Imported by main once torch is hidden: transformers would load it.
    from common.tokenizer import Tokenizer

DEFAULT_CONTROL = "tcp://127.0.0.1:8001"  # the HTTP port plus one, by convention


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pdserve router",
        description="The OpenAI-compatible router: workers register on its control socket.",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--control",
        default=DEFAULT_CONTROL,
        help=f"ZeroMQ endpoint to bind for workers (default {DEFAULT_CONTROL})",
    )
    p.add_argument(
        "--model",
        default=None,
        help="model folder: tokenizer, chat template and served name (default: SmolLM2-135M)",
    )
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="names the API answers to; the first is the one responses report (default: the "
        "model folder's name). The model's path is accepted as a name too, as vLLM serves it",
    )
    p.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY`")
    p.add_argument(
        "--enable-lora",
        action="store_true",
        help="serve LoRA adapters (docs/lora.md): a request names one as its model",
    )
    p.add_argument(
        "--lora-modules",
        nargs="+",
        type=parse_lora_module,
        default=[],
        metavar="NAME=PATH",
        help="the adapters the workers serve, as name=path or vLLM's JSON form: listed in "
        "/v1/models with the model as their parent",
    )
    p.add_argument(
        "--allow-runtime-lora-updating",
        action="store_true",
        help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING), behind --api-key like every route",
    )
    p.add_argument(
        "--remote-prefill-min-tokens",
        type=int,
        default=64,
        help="uncached prompt tokens below which a decode worker prefills locally (while it "
        "has less than twice this many of its own queued)",
    )
    p.add_argument(
        "--kv-host-hit-weight",
        type=float,
        default=HOST_HIT_WEIGHT,
        help="what a prompt page in a prefill worker's host-memory KV tier counts for against "
        f"one in its pool, 0 to 1 (default {HOST_HIT_WEIGHT}, measured: "
        "python -m benchmarks.kv_tier_weights)",
    )
    p.add_argument(
        "--kv-disk-hit-weight",
        type=float,
        default=DISK_HIT_WEIGHT,
        help="the same for a page in its disk KV tier "
        f"(default {DISK_HIT_WEIGHT}, measured likewise)",
    )
    p.add_argument(
        "--prefix-fetch",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="a prompt prefilled on a decode worker fetches the leading pages a prefill worker "
        "holds (in its pool or KV tiers) instead of computing them (ZeroMQ transfer only)",
    )
    p.add_argument(
        "--local-prefill-overflow-tokens",
        type=int,
        default=None,
        help="prefill on the decode worker when the prefill worker has this many tokens queued "
        "(and the decode worker none); default: never",
    )
    p.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=10.0,
        help="seconds of silence before a worker is taken out (its heartbeats go on during a "
        "step, so this need not outlast one)",
    )
    p.add_argument(
        "--request-stall-timeout",
        type=float,
        default=120.0,
        help="seconds a request may go without moving before it is sent again (a new attempt; "
        "it fails once --max-retries are spent). A request moves with every token, and with "
        "every heartbeat of its worker that lists it while it or the worker comes further: one "
        "queued or being prefilled is not sent again while its worker works",
    )
    p.add_argument(
        "--max-tokens-default",
        type=int,
        default=None,
        help="the most tokens a chat request without max_tokens gets (default: the rest of the "
        "context, as vLLM)",
    )
    p.add_argument(
        "--max-request-tokens",
        type=int,
        default=1 << 20,
        help="the most tokens one request may generate, n x prompts x max_tokens (a request "
        "without max_tokens counts what it defaults to); above it a 400. Default 1048576: n=128, "
        "the most, each to the end of an 8,192-token context",
    )
    p.add_argument("--max-retries", type=int, default=3, help="re-dispatches per request")
    p.add_argument("--max-body-bytes", type=int, default=4 << 20)
    p.add_argument("--max-model-len", type=int, default=None, help="default: the model's")
    p.add_argument("--max-inflight", type=int, default=4096, help="sequences; above it 429")
    p.add_argument(
        "--grammar-compile-timeout",
        type=float,
        default=10.0,
        help="seconds a structured output's schema or grammar may take to compile in the "
        "router's check before the request is refused with a 400",
    )
    p.add_argument(
        "--max-queue-delay",
        type=float,
        default=None,
        help="seconds a request may be predicted to wait before its work starts (from the "
        "workers' queues and measured pace); past it the request is refused at once with a 429 "
        "and Retry-After. Default: off (requests queue without bound, as in vLLM)",
    )
    p.add_argument(
        "--max-inflight-per-worker",
        type=int,
        default=None,
        help="requests one worker may hold; beyond it requests wait in the router's queue, "
        "lowest `priority` first, until a worker has room. Default: off",
    )
    p.add_argument(
        "--request-read-timeout",
        type=float,
        default=30.0,
        help="seconds a client has to send a whole request (headers and body); slower "
        "connections are closed",
    )
    p.add_argument(
        "--slo-ttft-ms",
        type=float,
        default=None,
        help="time-to-first-token objective: finished requests within it (and --slo-tpot-ms) "
        "count in pdserve_request_goodput_total",
    )
    p.add_argument(
        "--slo-tpot-ms", type=float, default=None, help="time-per-output-token objective"
    )
    p.add_argument(
        "--cluster-secret-file",
        default=None,
        help="the cluster secret's file (default: $PDSERVE_CLUSTER_SECRET); workers must hold it",
    )
    p.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="read tool calls from answers to tool_choice: auto, with --tool-call-parser "
        "(vLLM's flag; required and named tool choices need neither)",
    )
    p.add_argument(
        "--tool-call-parser",
        choices=tool_parser_names(),
        default=None,
        help="the format the model writes tool calls in, for tool_choice: auto",
    )
    p.add_argument(
        "--reasoning-parser",
        choices=reasoning_parser_names(),
        default=None,
        help="split each chat answer's <think> part into `reasoning`, and start a structured "
        "output or forced tool call after it",
    )
    add_insecure_flag(p)
    p.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error", "critical"]
    )
    return p


def config_from_args(args: argparse.Namespace, text: Tokenizer, model_path: Path) -> RouterConfig:
    if args.local_prefill_overflow_tokens is not None and args.local_prefill_overflow_tokens < 1:
        raise ValueError("--local-prefill-overflow-tokens must be >= 1")
    for name in ("kv_host_hit_weight", "kv_disk_hit_weight"):
        if not 0.0 <= getattr(args, name) <= 1.0:
            raise ValueError(f"--{name.replace('_', '-')} must be in [0, 1]")
    for name in ("remote_prefill_min_tokens", "max_retries"):
        if getattr(args, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0")
    if args.heartbeat_timeout <= 0 or args.request_stall_timeout <= 0:
        raise ValueError("--heartbeat-timeout and --request-stall-timeout must be > 0")
    if args.max_body_bytes < 1 or args.max_inflight < 1:
        raise ValueError("--max-body-bytes and --max-inflight must be >= 1")
    if args.request_read_timeout <= 0:
        raise ValueError("--request-read-timeout must be > 0")
    if args.max_tokens_default is not None and args.max_tokens_default < 1:
        raise ValueError("--max-tokens-default must be >= 1")
    if args.max_request_tokens < 1:
        raise ValueError("--max-request-tokens must be >= 1")
    for name in ("slo_ttft_ms", "slo_tpot_ms"):
        value = getattr(args, name)
        if value is not None and not 0 < value < float("inf"):
            raise ValueError(f"--{name.replace('_', '-')} must be a positive number of ms")
    if args.enable_auto_tool_choice and not args.tool_call_parser:  # vLLM's words
        raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")
    max_len = min(args.max_model_len or text.max_position_embeddings, text.max_position_embeddings)
    if max_len < 2:
        raise ValueError("--max-model-len must be >= 2")
    names = args.served_model_name or [model_path.name]
    if (args.lora_modules or args.allow_runtime_lora_updating) and not args.enable_lora:
        raise ValueError("--lora-modules and --allow-runtime-lora-updating need --enable-lora")
    path_names = {str(model_path), str(model_path.resolve()), *([args.model] if args.model else [])}
    return RouterConfig(
        served_model_name=names[0],
        model_aliases=tuple(names[1:]),
        model_path_names=tuple(sorted(path_names - set(names))),
        worker_model=model_path.name,
        max_model_len=max_len,
        control=args.control,
        api_key=args.api_key,
        heartbeat_timeout=args.heartbeat_timeout,
        request_stall_timeout=args.request_stall_timeout,
        default_max_tokens=args.max_tokens_default,
        max_request_tokens=args.max_request_tokens,
        max_retries=args.max_retries,
        max_body_bytes=args.max_body_bytes,
        max_inflight=args.max_inflight,
        grammar_compile_timeout=args.grammar_compile_timeout,
        # Workers connect to the control socket: it is what a stranger must not reach.
        cluster_secret=secret_for_binding(
            args.cluster_secret_file, [args.control], args.insecure_no_auth
        ),
        slo=ServiceLevel(
            ttft_s=None if args.slo_ttft_ms is None else args.slo_ttft_ms / 1000,
            tpot_s=None if args.slo_tpot_ms is None else args.slo_tpot_ms / 1000,
        ),
        admission=AdmissionConfig(
            max_queue_delay_s=args.max_queue_delay,
            max_inflight_per_worker=args.max_inflight_per_worker,
        ),
        routing=RoutingConfig(
            remote_prefill_min_tokens=args.remote_prefill_min_tokens,
            local_prefill_overflow_tokens=args.local_prefill_overflow_tokens,
            host_hit_weight=args.kv_host_hit_weight,
            disk_hit_weight=args.kv_disk_hit_weight,
            prefix_fetch=args.prefix_fetch,
        ),
        parsing=OutputParsing(
            enable_auto_tool_choice=args.enable_auto_tool_choice,
            tool_call_parser=args.tool_call_parser,
            reasoning_parser=args.reasoning_parser,
        ),
        enable_lora=args.enable_lora,
        allow_runtime_lora_updating=args.allow_runtime_lora_updating,
        lora_adapters=router_adapters(args.lora_modules, set(names)),
    )


def router_adapters(modules: list[LoraModule], model_names: set[str]) -> dict[str, RouterAdapter]:
    """``--lora-modules`` as the router keeps them: each adapter's namespace from its files."""
    adapters: dict[str, RouterAdapter] = {}
    for module in modules:
        if module.name in adapters or module.name in model_names:
            raise ValueError(f"--lora-modules: the name {module.name!r} is taken")
        adapters[module.name] = RouterAdapter(
            module.name, module.path, adapter_namespace(module.name, module.path)
        )
    return adapters


def hide_torch() -> None:
    """Keep torch out of the router's process. The router runs no model, yet transformers
    imports torch wherever it is installed, and torch's distributed and symbolic-shape modules
    with it: 5 s of the 7.5 the router took to load SmolLM2's tokenizer on a 2-core EPYC, and
    240 MiB of its 380 resident, for a tokenizer that needs neither. A None entry in
    sys.modules makes ``import torch`` raise ImportError and ``find_spec`` answer None, so
    transformers loads as where torch is not installed. Not where torch is loaded already."""
    if "torch" not in sys.modules:
        sys.modules["torch"] = None  # type: ignore[assignment]
        # transformers says, on import, that it will have no models: the router wants none.
        logging.getLogger("transformers").addFilter(
            lambda record: not record.getMessage().startswith("PyTorch was not found")
        )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    import uvicorn

    from common.model.default_model import resolve_model_path

    try:
        # Converting the default model on its first use needs torch: resolved before it is hidden.
        model_path = resolve_model_path(args.model)
        hide_torch()
        from common.tokenizer import Tokenizer

        text = Tokenizer(model_path)
        config = config_from_args(args, text, model_path)
    except (ValueError, OSError, ImportError) as exc:
        print(f"pdserve router: {exc}", file=sys.stderr)
        return 2
    app = create_app(config, text)
    with startup_objects_frozen():  # the tokenizer's imports: no collection walks them again
        uvicorn.run(
            app,
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            access_log=False,
            http=with_read_deadline(args.request_read_timeout),
        )
    return 0
