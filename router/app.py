"""``create_app``: the router's FastAPI app.

It builds what the routes share once (``RouterState``: metrics, worker registry, dispatcher,
token text, load; router/state.py), and the control socket workers register on, which starts and
stops with the app. The routes live by concern: the checks at the door and the error shape in
router/edge.py, /v1/completions and /v1/chat/completions in router/routes_generation.py, the
rest (models, workers, health, metrics, load, tokenize) in router/routes_ops.py.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator

from fastapi import FastAPI

from common.cluster_auth import ClusterAuth
from router import lora_routes, role_switch, routes_generation, routes_ops
from router.config import RouterConfig
from router.control import ControlServer
from router.dispatcher import Dispatcher
from router.edge import OFFLOAD_BODY_BYTES, Edge, install_error_handlers
from router.memory_release import ReleaseFreedMemory
from router.metrics import RouterMetrics
from router.openai_api import TextCodec
from router.registry import WorkerRegistry
from router.serving import TokenText
from router.state import RouterState, ServerLoad
from router.structured_request import GrammarCheck

logger = logging.getLogger(__name__)


def _grammar_check(config: RouterConfig, codec: TextCodec) -> GrammarCheck | None:
    """The check of structured outputs, over the served model's own tokenizer (a test's
    stand-in codec has none: its requests' specs go unchecked)."""
    hf_tokenizer = getattr(codec, "hf_tokenizer", None)
    if hf_tokenizer is None:
        return None
    return GrammarCheck(
        hf_tokenizer, codec.vocab_size, list(codec.eos_token_ids), config.grammar_compile_timeout
    )


def create_app(config: RouterConfig, codec: TextCodec) -> FastAPI:
    metrics = RouterMetrics(config.slo)
    registry = WorkerRegistry(
        config.worker_model or config.served_model_name, config.heartbeat_timeout
    )
    auth = ClusterAuth(
        config.cluster_secret, lambda name: metrics.auth_failures.labels(socket=name).inc()
    )
    control = ControlServer(config.control, config.heartbeat_timeout, auth)
    dispatcher = Dispatcher(
        registry,
        config.routing,
        metrics,
        control.send,
        config.max_retries,
        heartbeat_interval=min(1.0, config.heartbeat_timeout / 3),
        stall_timeout=config.request_stall_timeout,
        admission=config.admission,
    )
    state = RouterState(
        config=config,
        codec=codec,
        edge=Edge(config, dispatcher.new_request_id),
        metrics=metrics,
        registry=registry,
        dispatcher=dispatcher,
        token_text=TokenText(codec.decode),
        load=ServerLoad(),
        grammar_check=_grammar_check(config, codec),
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        control.start(dispatcher)
        logger.info("control socket bound at %s", control.endpoint)
        yield
        await control.stop()

    app = FastAPI(title="pdserve router", version="0.1.0", lifespan=lifespan)
    app.state.config = config
    app.state.control = control
    app.state.dispatcher = dispatcher
    app.state.registry = registry
    app.state.metrics = metrics
    app.state.load = state.load

    install_error_handlers(app, metrics)
    # Bodies that are parsed in a thread are the ones whose freed memory stays in its arena.
    app.add_middleware(ReleaseFreedMemory, min_body_bytes=OFFLOAD_BODY_BYTES)
    routes_generation.add_routes(app, state)
    routes_ops.add_routes(app, state)
    lora_routes.add_routes(app, state)
    # Role switches: by HTTP, and by whatever else in the router holds app.state.role_switches.
    switches = role_switch.RoleSwitches(
        registry,
        dispatcher.send,
        metrics,
        settled=dispatcher.dispatch_waiting,
        move_off=dispatcher.move_off,
    )
    dispatcher.on_role_switch_result = switches.on_result
    app.state.role_switches = switches
    role_switch.add_routes(app, state, switches)
    return app
