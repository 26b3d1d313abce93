"""The router's settings: ``RouterConfig``, built from the command line by router/server.py."""

from __future__ import annotations

from dataclasses import dataclass, field

from router.admission import AdmissionConfig
from router.policy import RoutingConfig
from router.request_metrics import ServiceLevel


@dataclass(slots=True)
class OutputParsing:
    """How chat answers are read (vLLM's flags): tool calls in the answer, for ``tool_choice:
    auto``, and the reasoning before it (router/chat_output.py)."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None  # a name of router/tool_parsers
    reasoning_parser: str | None = None  # a name of router/reasoning

    @property
    def auto_tool_choice(self) -> bool:
        """Whether ``tool_choice: auto`` is served: it needs both flags, as in vLLM."""
        return self.enable_auto_tool_choice and self.tool_call_parser is not None


@dataclass(slots=True)
class RouterConfig:
    served_model_name: str  # the name responses report, and the first in /v1/models
    max_model_len: int
    # Other names requests may use: --served-model-name's others (listed in /v1/models), and
    # the model's path (accepted, not listed), as vLLM serves a model under the path it was given.
    model_aliases: tuple[str, ...] = ()
    model_path_names: tuple[str, ...] = ()
    # The model name workers register with (their model folder's name); None: the served name.
    worker_model: str | None = None
    control: str = "tcp://127.0.0.1:8001"
    api_key: str | None = None
    heartbeat_timeout: float = 3.0
    # Seconds a request may go without moving before it is sent again (a new attempt).
    request_stall_timeout: float = 120.0
    # The most tokens a chat request without max_tokens gets; None: the rest of the context.
    default_max_tokens: int | None = None
    # The most tokens one request may generate, n x prompts x max_tokens; more -> 400.
    max_request_tokens: int = 1 << 20
    max_retries: int = 3
    max_body_bytes: int = 4 << 20
    max_inflight: int = 4096  # sequences in flight; more -> 429
    # Seconds the check of a structured output's grammar may take; longer -> 400.
    grammar_compile_timeout: float = 10.0
    # Workers must prove it on the control socket (common/cluster_auth); None: in the clear.
    cluster_secret: str | None = None
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    slo: ServiceLevel = field(default_factory=ServiceLevel)  # what counts as goodput
    parsing: OutputParsing = field(default_factory=OutputParsing)
    # LoRA adapters served over the model (--enable-lora, --lora-modules): name -> what the
    # router knows of it. A request names one as its model.
    lora_adapters: dict[str, RouterAdapter] = field(default_factory=dict)
    enable_lora: bool = False
    # POST /v1/load_lora_adapter and /v1/unload_lora_adapter (router/lora_routes.py).
    allow_runtime_lora_updating: bool = False


@dataclass(frozen=True, slots=True)
class RouterAdapter:
    """A LoRA adapter as the router lists and routes it."""

    name: str
    path: str
    # Its prefix-cache namespace (common/lora_adapters.py): the workers file its pages under it,
    # so the router hashes its prompts so too to find them.
    cache_namespace: str
