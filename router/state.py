"""What the router's routes share: ``RouterState``, built once by ``create_app`` (router/app.py)
and handed to each route module's ``add_routes``; and ``ServerLoad``, the count /load reports."""

from __future__ import annotations

from dataclasses import dataclass

from router.config import RouterConfig
from router.dispatcher import Dispatcher
from router.edge import Edge
from router.metrics import RouterMetrics
from router.openai_api import TextCodec
from router.registry import WorkerRegistry
from router.serving import TokenText
from router.structured_request import GrammarCheck


@dataclass(slots=True)
class ServerLoad:
    """Generation requests being answered (vLLM's ``/load``): a load balancer in front of
    several routers reads it."""

    requests: int = 0


@dataclass(slots=True)
class RouterState:
    config: RouterConfig
    codec: TextCodec  # the served model's tokenizer and chat template
    edge: Edge
    metrics: RouterMetrics
    registry: WorkerRegistry
    dispatcher: Dispatcher
    token_text: TokenText
    load: ServerLoad
    grammar_check: GrammarCheck | None = None  # None: structured outputs go unchecked
