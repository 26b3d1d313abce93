"""The one-process engine: chunked prefill and continuous batching in one loop.

It is both a user-facing command (``pdserve generate``) and the reference the disaggregated
path is checked against. The loop is ``schedule() -> run() -> postprocess()``.

With ``--tensor-parallel-size N`` the engine the caller builds is rank 0 of N: it spawns the
other ranks (``common/engine/tp_group.py``), each an ``LLMEngine`` of its own shard whose
runner only runs the forwards rank 0 sends it; rank 0 alone schedules and samples.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import time
from collections.abc import Iterable
from contextlib import nullcontext
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch

from common.config import (
    EngineConfig,
    ModelConfig,
    SpeculativeConfig,
    default_token_budget,
    resolve_dtype,
)
from common.context_window import all_layers_slide
from common.cost_model import CostModel
from common.engine.batch import ScheduledSequence, SequenceOutput
from common.engine.cuda_graphs import DecodeGraphs, capture_sizes
from common.engine.kv_pool import KVPool, dtype_name, kv_layout
from common.engine.kv_tiers.block import kv_fingerprint
from common.engine.kv_tiers.tiers import KVTiers
from common.engine.lora import LoraManager
from common.engine.memory import plan_num_pages, warm_up, warms_up
from common.engine.model_runner import AroundForward, LaunchedDecodes, ModelRunner
from common.engine.page_manager import PageManager
from common.engine.sampler import PromptLogprob, SampledToken, Sampler
from common.engine.scheduler import DecodeScheduler, PrefillScheduler, Scheduler
from common.engine.sequence import FinishReason, Sequence, first_output_prompt_logprobs
from common.engine.simulated import (
    SIM_HEAD_DIM,
    SIM_NUM_KV_HEADS,
    SIM_NUM_LAYERS,
    SimulatedModel,
    SimulatedRunner,
)
from common.engine.speculative.draft import DraftModelProposer
from common.engine.speculative.ngram import NgramProposer
from common.engine.speculative.speculator import Proposer, Speculator
from common.engine.structured.compiler import GrammarCompiler
from common.engine.tp_group import (
    FollowerRank,
    FollowerRanks,
    ignore_stop_signals,
    serve_steps,
    take_share_of_cores,
)
from common.kv_layout import KVLayout
from common.metrics import STEPS_LAUNCHED_AHEAD
from common.model.default_model import resolve_model_path
from common.model.llama import LlamaForCausalLM
from common.model.loader import load_model
from common.model.lora import attach_lora
from common.model.parallel import TensorParallel, check_shardable, connect
from common.sampling_params import SamplingParams
from common.startup_objects import startup_objects_frozen
from kernels.cpu.huge_pages import huge_page_bytes
from kernels.interface import FP8_DTYPE, INT8_DTYPE
from kernels.layer_kernels import CpuKernels, CudaKernels, CudaQuantizedKernels, InvariantKernels
from kernels.quantized import DYNAMIC_PER_TENSOR, QuantizedLinear
from kernels.registry import get_attention_backend
from kernels.triton.elementwise import cuda_ops_apply

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request."""

    request_id: str
    new_samples: list[SampledToken]
    finish_reason: FinishReason | None  # None while it runs
    num_prompt_tokens: int
    num_cached_tokens: int
    # With the first token, when params.prompt_logprobs asked: prompt tokens 1.. scored.
    prompt_logprobs: list[PromptLogprob] | None = None
    error: str | None = None  # why it was given up (its grammar could not be compiled)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        role: str | None = None,
        tp_rank: int = 0,
        tp_port: int | None = None,
    ) -> None:
        """``role``: "prefill" or "decode" for a worker's engine (each has its own scheduler,
        see ``common/engine/scheduler``), None for the one-process engine. ``tp_rank`` and
        ``tp_port``: set only in the ranks rank 0 spawns (their rank, rank 0's rendezvous)."""
        if role not in (None, "prefill", "decode"):
            raise ValueError(f"unknown engine role {role!r}")
        started = time.monotonic()
        config.validate()
        self.device = _rank_device(config.resolve_device(), tp_rank)
        self.model_path = resolve_model_path(config.model)
        self.model_config = ModelConfig.from_pretrained(self.model_path)
        if config.simulated_engine is not None:
            self._build_simulated(config, role, started)
            return
        tp_size = config.tensor_parallel_size
        check_shardable(self.model_config, tp_size, config.enable_expert_parallel)
        # Rank 0 spawns the others before the rendezvous, which waits for all of them.
        self.followers: FollowerRanks | None = None
        if tp_size > 1 and tp_rank == 0:
            self.followers = FollowerRanks(functools.partial(_serve_as_rank, config, role), tp_size)
            tp_port = self.followers.port
        # Each rank its slice of the worker's cores, rank 0 once the others have started (they
        # inherit its affinity); the one-process engine leaves its caller's process as it is.
        if tp_size > 1 and self.device.type == "cpu" and (tp_rank > 0 or role is not None):
            take_share_of_cores(tp_rank, tp_size)
        try:
            self._build(config, role, tp_rank, tp_port, started)
        except BaseException:
            self.close()  # the other ranks leave rather than wait for a rank 0 that failed
            raise

    def _build(
        self,
        config: EngineConfig,
        role: str | None,
        tp_rank: int,
        tp_port: int | None,
        started: float,
    ) -> None:
        """Everything after the other ranks are spawned: see ``__init__``."""
        deterministic = config.enable_deterministic_inference
        tp_size = config.tensor_parallel_size
        self.tp = TensorParallel()
        if tp_size > 1:
            assert tp_port is not None, "a rank other than 0 is given rank 0's port"
            self.tp = connect(
                tp_rank,
                tp_size,
                tp_port,
                self.device,
                deterministic,
                config.enable_expert_parallel,
            )
        self.dtype = resolve_dtype(config.dtype, self.model_config.checkpoint_dtype, self.device)
        if config.scheduler.max_num_batched_tokens is None:
            budget = default_token_budget(self.device, self.dtype)
            config = dataclasses.replace(
                config,
                scheduler=dataclasses.replace(config.scheduler, max_num_batched_tokens=budget),
            )
        self.config = config
        torch.manual_seed(config.seed)
        kv_dtype = {"fp8": FP8_DTYPE, "int8": INT8_DTYPE}.get(
            config.cache.kv_cache_dtype, self.dtype
        )
        self.backend = get_attention_backend(self.device, deterministic=deterministic)
        self.model = load_model(
            self.model_config,
            self.dtype,
            self.device,
            config.load_format,
            self.tp,
            config.quantization,
        )
        if deterministic:
            _check_batch_invariant_rounding(self.model)
        if kv_dtype == INT8_DTYPE:
            self.model.turn_kv_heads()
        self._prepare_kernels(self.model, log=True)
        self.lora = self._serve_adapters(config)
        self.max_model_len = min(
            config.scheduler.max_model_len or self.model_config.max_position_embeddings,
            self.model_config.max_position_embeddings,
        )
        self.kv_layout = kv_layout(
            kv_dtype,
            config.cache.page_size,
            self.model_config.num_layers,
            len(self.tp.kv_heads(self.model_config.num_kv_heads)),  # this rank's heads only
            self.model_config.head_dim,
        )
        if self.tp.size > 1:
            self.kv_layout = dataclasses.replace(
                self.kv_layout,
                first_kv_head=self.tp.kv_heads(self.model_config.num_kv_heads).start,
                model_kv_heads=self.model_config.num_kv_heads,
            )
        self.sampler = Sampler(self.model_config.vocab_size, self.model_config.eos_token_ids)
        # The prefill worker only ever samples a first token: nothing to speculate on. Under
        # tensor parallelism rank 0 alone proposes (with a draft model, unsharded, beside its
        # shard of the target): the other ranks verify the proposals in the target's forward,
        # as any run rank 0 sends them.
        speculative = config.speculative
        if role == "prefill" or tp_rank > 0:
            speculative = SpeculativeConfig()
        draft = self._load_draft(speculative.model, kv_dtype) if speculative.model else None
        graph_sizes = self._cuda_graph_sizes(role)
        num_pages = plan_num_pages(
            self.model,
            self.kv_layout,
            config,
            self.device,
            self.backend,
            self.max_model_len,
            extra_bytes_per_page=draft[1].bytes_per_page if draft else 0,
            graph_batch=max(graph_sizes, default=0),
        )
        if self.tp.size > 1 and self.device.type == "cpu" and config.cache.num_pages is None:
            # The ranks share the host's memory (a GPU rank has its own): together they take
            # the one budget a worker would, each a size-th of it.
            num_pages //= self.tp.size
            if num_pages * config.cache.page_size < self.max_model_len:
                raise ValueError(
                    f"split over {self.tp.size} ranks, the KV cache holds "
                    f"{num_pages * config.cache.page_size} tokens, less than one sequence of "
                    f"the maximum model length {self.max_model_len}: give it more memory "
                    "(--kv-cache-memory) or lower --max-model-len"
                )
        # Every rank holds the same page ids: the pool is as big as the smallest rank's.
        num_pages = self.tp.agree_min(num_pages, self.device)
        self.pool = KVPool(self.kv_layout, num_pages, self.device)
        self.model.bind_kv(self.pool, self.backend)
        self.page_manager = PageManager(
            num_pages, config.cache.page_size, config.cache.enable_prefix_caching
        )
        self.tiers = self._build_tiers(config) if config.cache.has_kv_tiers else None
        self.page_manager.tiers = self.tiers
        self.speculator = self._build_speculator(speculative, draft, num_pages)
        eos = self.model_config.eos_token_ids
        # Structured outputs: grammars compiled off the step thread, from the model's tokenizer
        # (loaded on the first one; a rank other than 0 samples nothing and compiles none).
        self.grammars = GrammarCompiler(self.model_path, self.model_config.vocab_size, list(eos))
        self.role = role
        self._has_draft = draft is not None
        self.scheduler: Scheduler = self._new_scheduler(role)
        self.runner = ModelRunner(self.model, self.pool, self.sampler, self.speculator)
        self.runner.followers = self.followers
        if self.lora is not None:
            self.runner.lora = self.lora
        if graph_sizes:
            self.runner.graphs = self._capture_decode_graphs(graph_sizes)
        self.steps_ahead = self._steps_ahead_wanted(role)
        self._ahead: LaunchedDecodes | None = None  # launched, its tokens not read yet
        self._ids = itertools.count()
        logger.info(
            "engine ready in %.1f s: %s on %s in %s, %d KV pages of %d tokens (%s%s), "
            "%s attention%s%s%s%s%s",
            time.monotonic() - started,
            self.model_config.architecture,
            self.device,
            self.dtype,
            num_pages,
            config.cache.page_size,
            self.kv_layout.describe(dtype_name(self.dtype)),
            self._pool_pages_said(),
            self.backend.name,
            ", eager" if config.enforce_eager else "",
            ", CUDA graphs for decode" if self.runner.graphs is not None else "",
            ", deterministic inference (batch-invariant kernels)" if deterministic else "",
            f", tensor-parallel rank {tp_rank} of {tp_size}" if tp_size > 1 else "",
            ", decode steps launched ahead" if self.steps_ahead else "",
        )

    def _build_simulated(self, config: EngineConfig, role: str | None, started: float) -> None:
        """The simulated engine (``common/engine/simulated.py``): the real scheduler and page
        manager over a pool of tiny pages, and a runner that sleeps for its cost model's time.
        No weights are read, only the model's configuration (vocabulary, context length)."""
        assert config.simulated_engine is not None
        cost = CostModel.load(config.simulated_engine)
        budget = config.scheduler.max_num_batched_tokens or cost.max_num_batched_tokens or 256
        config = dataclasses.replace(
            config,
            scheduler=dataclasses.replace(config.scheduler, max_num_batched_tokens=budget),
        )
        self.config = config
        self.device = torch.device("cpu")  # sleeping needs no accelerator, whatever the host has
        self.followers = None
        self.tp = TensorParallel()
        self.dtype = torch.float16
        self.model = SimulatedModel()  # type: ignore[assignment]  # nothing runs: the runner sleeps
        self.lora = None
        self.tiers = None
        self.speculator = None
        self.max_model_len = min(
            config.scheduler.max_model_len or self.model_config.max_position_embeddings,
            self.model_config.max_position_embeddings,
        )
        page_size = config.cache.page_size
        self.kv_layout = kv_layout(
            torch.float16, page_size, SIM_NUM_LAYERS, SIM_NUM_KV_HEADS, SIM_HEAD_DIM
        )
        num_pages = config.cache.num_pages or max(1, cost.kv_tokens // page_size)
        self.pool = KVPool(self.kv_layout, num_pages, self.device)
        self.page_manager = PageManager(num_pages, page_size, config.cache.enable_prefix_caching)
        eos = self.model_config.eos_token_ids
        self.grammars = GrammarCompiler(self.model_path, self.model_config.vocab_size, list(eos))
        self.role = role
        self._has_draft = False
        self.scheduler = self._new_scheduler(role)
        self.runner = SimulatedRunner(cost, self.model_config.vocab_size, eos)  # type: ignore[assignment]
        self.steps_ahead = False
        self._ahead = None
        self._ids = itertools.count()
        logger.info(
            "simulated engine ready in %.1f s: %s's vocabulary, %d pages of %d tokens, "
            "%d tokens per step; step cost %s",
            time.monotonic() - started,
            self.model_path.name,
            num_pages,
            page_size,
            budget,
            cost.source or config.simulated_engine,
        )

    def _new_scheduler(self, role: str | None) -> Scheduler:
        """An empty scheduler of ``role`` (see ``__init__``) over this engine's page manager."""
        scheduling = (self.config.scheduler, self.page_manager, self.max_model_len)
        eos = self.model_config.eos_token_ids
        scheduler: Scheduler
        if role == "prefill":
            scheduler = PrefillScheduler(*scheduling, eos, grammars=self.grammars)
        else:
            scheduler_class = DecodeScheduler if role == "decode" else Scheduler
            scheduler = scheduler_class(
                *scheduling,
                eos,
                self.speculator,
                grammars=self.grammars,
                release_window=self._release_window(self._has_draft),
            )
        if self.lora is not None:
            scheduler.max_adapters = self.lora.max_loras
            scheduler.adapters = self.lora
        scheduler.tiers = self.tiers
        return scheduler

    def set_role(self, role: str, scheduler: Scheduler | None = None) -> Scheduler:
        """Serve ``role`` ("prefill" or "decode") from now on, with the same weights, KV pool and
        page manager (a worker's live role switch, common/service/role_switch.py): a new empty
        scheduler of the role, or ``scheduler`` (the one this returned, to go back). Returns
        the scheduler it replaces. Only between steps, with nothing left to step, and not over
        tensor-parallel ranks (theirs would stay in the old role) nor with a speculator (a
        prefill engine is built without one)."""
        if role not in ("prefill", "decode"):
            raise ValueError(f"unknown engine role {role!r}")
        if self.has_unfinished:
            raise ValueError("the engine still has work: a role changes only when it has none")
        if self.tp.size > 1 or self.speculator is not None:
            raise ValueError("an engine over tensor-parallel ranks or with a speculator keeps "
                             "its role")  # fmt: skip
        previous = self.scheduler
        self.scheduler = scheduler if scheduler is not None else self._new_scheduler(role)
        self.role = role
        self.steps_ahead = self._steps_ahead_wanted(role)
        return previous

    def _build_tiers(self, config: EngineConfig) -> KVTiers:
        """The KV tiers below the pool, their disk blocks fingerprinted by the weights and the
        page format (a block of other weights or another format is a miss)."""
        cache = config.cache
        weights = "|".join(
            (
                str(self.model_path),
                str(self.dtype),
                str(config.quantization),
                str(config.load_format),
            )
        )
        tiers = KVTiers(
            self.pool,
            host_bytes=cache.kv_offloading_size,
            disk_dir=cache.kv_offloading_dir,
            disk_bytes=cache.kv_offloading_disk_size,
            fingerprint=kv_fingerprint(weights, self.kv_layout),
        )
        logger.info(
            "KV tiers below the pool: %s%s",
            f"host {tiers.host.num_slots} pages" if tiers.host is not None else "no host tier",
            f", disk {cache.kv_offloading_dir}" if tiers.disk is not None else "",
        )
        return tiers

    def _serve_adapters(self, config: EngineConfig) -> LoraManager | None:
        """With ``--enable-lora``: the adapter slots on every layer, and ``--lora-modules``
        read and checked (``ValueError`` naming a bad one)."""
        if not config.lora.enable_lora:
            return None
        slots = attach_lora(
            self.model, config.lora.max_loras, config.lora.max_lora_rank, self.dtype
        )
        manager = LoraManager(config.lora, self.model_config, slots)
        for name, path in config.lora.modules.items():
            manager.add(name, path)
        return manager

    def _release_window(self, has_draft: bool) -> int | None:
        """The window behind which a running sequence's pages go back to the pool: the widest
        of the layers', where every layer slides. A page holds every layer's KV of its
        positions, so one full-attention layer keeps them all (a pool per group of layers, as
        the sliding ones could use, is not built). A draft model keeps its own KV in the same
        page ids, read from its own positions: with one, nothing goes back either."""
        windows = self.model_config.layer_windows
        if has_draft or not all_layers_slide(windows):
            return None
        return max(window for window in windows if window is not None)

    def _steps_ahead_wanted(self, role: str | None) -> bool:
        """Whether decode steps are launched before the last one's tokens are read
        (``run_step``): as --async-scheduling says, by default on CUDA alone. Never in a
        prefill worker (its rows leave after one token), with a speculator (how many tokens a
        step yields is known only once it is read) or over tensor-parallel ranks (rank 0 sends
        them each step's token ids)."""
        wanted = self.config.scheduler.async_scheduling
        if wanted is None:
            wanted = self.device.type == "cuda"
        return wanted and role != "prefill" and self.speculator is None and self.tp.size == 1

    def _pool_pages_said(self) -> str:
        """On the CPU, how much of the KV pool the kernel gave 2 MB pages
        (kernels/cpu/huge_pages.py), for the start-up log: a pool left on 4 KB pages decodes
        slower."""
        if self.device.type != "cpu":
            return ""
        data = self.pool.data
        share = huge_page_bytes(data) / max(1, data.numel() * data.element_size())
        return f", {min(share, 1.0):.0%} on 2 MB pages"

    def _cuda_graph_sizes(self, role: str | None) -> list[int]:
        """The decode batch sizes to capture CUDA graphs for: on CUDA with the Triton kernels
        (the torch backend reads its metadata on the host), unless --enforce-eager; a prefill
        worker never decodes. Not under tensor parallelism: every rank would have to replay
        its graphs, collectives included, in step with rank 0."""
        if (
            self.tp.size > 1
            or self.device.type != "cuda"
            or self.backend.name != "triton"
            or self.config.enforce_eager
            or role == "prefill"
        ):
            return []
        return capture_sizes(self.config.scheduler.max_num_seqs)

    def _capture_decode_graphs(self, sizes: list[int]) -> DecodeGraphs | None:
        """The decode graphs, or None (every step eager) if capturing fails: a model or kernel
        that cannot be recorded costs speed, not the worker."""
        graphs = DecodeGraphs(
            self.model,
            sizes,
            self.max_model_len,
            self.config.cache.page_size,
            self.device,
            adapters=self.lora is not None,
        )
        try:
            graphs.capture()
        except RuntimeError as exc:
            logger.warning("CUDA graph capture failed, decoding eagerly: %s", exc)
            return None
        return graphs

    def _prepare_kernels(self, model: LlamaForCausalLM, log: bool) -> None:
        """Put the kernels this engine runs into ``model``: in deterministic mode on the Triton
        path, the batch-invariant Triton linears and norms; on a CPU, the packed C GEMMs
        (batch-invariant tiles in deterministic mode); on CUDA, one-kernel norms, activation
        and RoPE (16-bit models); else torch's own modules."""
        deterministic = self.config.enable_deterministic_inference
        dtype, head_dim = self.dtype, model.config.head_dim
        if deterministic and self.backend.name == "triton":
            model.use_kernels(InvariantKernels())
            if log:
                logger.info("linear layers and norms: batch-invariant Triton kernels")
        elif self.device.type == "cpu" and not self.config.enforce_eager:
            num_params = sum(p.numel() for p in model.parameters())
            kernels = CpuKernels(dtype, num_params, head_dim, deterministic)
            model.use_kernels(kernels)
            gemm_plan = kernels.settle_plan(model.modules())
            model.fuse_layers()  # each layer as one C call where its kernels allow
            if log:
                logger.info("linear layers: %s", gemm_plan.describe())
        elif self.device.type == "cuda" and not self.config.enforce_eager:
            if not cuda_ops_apply(dtype, head_dim):
                model.use_kernels(CudaQuantizedKernels())  # a float32 model's quantized layers
                return
            model.use_kernels(CudaKernels())
            if log:
                logger.info("RMSNorm, SiLU-and-multiply and RoPE: one Triton kernel each")

    def _load_draft(self, folder: str, kv_dtype: torch.dtype) -> tuple[LlamaForCausalLM, KVLayout]:
        """The draft model, in the target's dtype, and the layout of its KV pages."""
        draft_config = ModelConfig.from_pretrained(resolve_model_path(folder))
        if draft_config.vocab_size > self.model_config.vocab_size + 1024:
            raise ValueError(
                f"the draft model's vocabulary ({draft_config.vocab_size}) is not the target's "
                f"({self.model_config.vocab_size}): a draft must share the target's tokenizer"
            )
        draft = load_model(draft_config, self.dtype, self.device, self.config.load_format)
        if kv_dtype == INT8_DTYPE:
            draft.turn_kv_heads()
        self._prepare_kernels(draft, log=False)
        layout = kv_layout(
            kv_dtype,
            self.config.cache.page_size,
            draft_config.num_layers,
            draft_config.num_kv_heads,
            draft_config.head_dim,
        )
        logger.info("draft model %s: %d layers", folder, draft_config.num_layers)
        return draft, layout

    def _build_speculator(
        self,
        config: SpeculativeConfig,
        draft: tuple[LlamaForCausalLM, KVLayout] | None,
        num_pages: int,
    ) -> Speculator | None:
        if not config.enabled:
            return None
        proposer: Proposer
        if draft is None:
            proposer = NgramProposer(config.ngram_min, config.ngram_max)
        else:
            model, layout = draft
            if warms_up(self.config, self.device):
                # A draft of another shape launches kernel variants of its own: compiled here,
                # not at the first step that speculates.
                tokens = min(self.config.scheduler.token_budget, self.max_model_len)
                warm_up(model, layout, tokens, self.backend)
            # The draft's pages share the target's ids: one page table serves both.
            pool = KVPool(layout, num_pages, self.device)
            model.bind_kv(pool, self.backend)
            proposer = DraftModelProposer(
                model,
                pool,
                self.model_config.vocab_size,
                self.config.scheduler.token_budget,
            )
        logger.info(
            "speculative decoding: %s, up to %d tokens per step",
            config.method,
            config.num_speculative_tokens,
        )
        return Speculator(config, proposer)

    def close(self) -> None:
        """Stop the other ranks of a tensor-parallel group, and the grammar compiler."""
        grammars = getattr(self, "grammars", None)  # absent where the build failed before it
        if grammars is not None:
            grammars.close()
        tiers = getattr(self, "tiers", None)
        if tiers is not None:
            tiers.close()
        if self.followers is not None:
            self.followers.close()

    def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        lora_name: str | None = None,
    ) -> str:
        """Queue a prompt; ``lora_name``: the adapter it computes under (None: the base)."""
        params.check_token_ids(self.model_config.vocab_size)
        bad = [t for t in prompt_token_ids if not 0 <= t < self.model_config.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids out of the vocabulary: {bad[:5]}")
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        seq = Sequence.from_prompt(request_id, prompt_token_ids, params)
        self.put_under_adapter(seq, lora_name)
        self.scheduler.add(seq)
        return request_id

    def put_under_adapter(self, seq: Sequence, lora_name: str | None) -> None:
        """Make ``seq`` compute under LoRA adapter ``lora_name`` (None: the base model), its
        pages hashed in the adapter's namespace (``ValueError`` if this engine does not serve
        it)."""
        if lora_name is not None:
            seq.cache_namespace = self.adapter_namespace(lora_name)
            seq.lora_name = lora_name

    def adapter_namespace(self, lora_name: str) -> str:
        """The prefix-cache namespace of adapter ``lora_name`` (``ValueError`` if this engine
        does not serve it)."""
        if self.lora is None:
            raise ValueError(
                f"the LoRA adapter {lora_name!r} does not exist: this engine serves none "
                "(--enable-lora)"
            )
        return self.lora.namespace(lora_name)

    def abort(self, request_id: str) -> bool:
        return self.scheduler.abort(request_id) is not None

    @property
    def has_unfinished(self) -> bool:
        """Work to step: sequences the scheduler holds, or a step launched ahead to read."""
        return self.scheduler.has_work or self._ahead is not None

    def run_step(
        self, around_forward: AroundForward | None = None
    ) -> tuple[list[ScheduledSequence], list[SequenceOutput]]:
        """One step, ``schedule() -> run() -> postprocess()``: the step loop of this engine and
        of every worker (``common/service/worker_base.py``), which serves its sockets during
        the forward through ``around_forward``. Returns the batch and what each of its sampling
        sequences gained.

        With ``steps_ahead``, a step of decodes whose tokens are drawn from their logits alone
        (``ModelRunner.launches``: greedy or sampled, not penalised or reporting logprobs) is
        launched,
        and before its tokens are read the step after it too where the scheduler knows it
        without them (``Scheduler.schedule_ahead``): the same rows, fed those tokens on the
        device. So on a GPU the next forward is queued behind this one while the host reads
        this one's tokens, postprocesses and sends them, and the device never waits on the
        host between steps. The next call reads that step instead of scheduling one. A row
        whose sequence stopped at the token before is computed for nothing and dropped; the
        tokens are those of the steps taken one at a time."""
        launched = self._ahead
        if launched is None:
            # Nothing is in flight: whatever a step ahead left held (one that raised) is free.
            self.scheduler.release_held_pages()
            batch = self.scheduler.schedule()
            if not (self.steps_ahead and self.runner.launches(batch)):
                runs = self.runner.run(batch, around_forward)
                return batch, self.scheduler.postprocess(batch, runs)
        with around_forward if around_forward is not None else nullcontext():
            if launched is None:
                launched = self.runner.launch_decodes(batch)
            ahead = self.scheduler.schedule_ahead(launched.batch) if self.steps_ahead else None
            self._ahead = None
            if ahead is not None:
                self._ahead = self.runner.launch_decodes(ahead, launched)
                STEPS_LAUNCHED_AHEAD.inc()
            if around_forward is not None:
                around_forward.device_launched()
            runs = self.runner.collect(launched)
        outputs = self.scheduler.postprocess(launched.batch, runs)
        if self._ahead is None:
            self.scheduler.release_held_pages()
        return launched.batch, outputs

    def step(self) -> list[RequestOutput]:
        _, outputs = self.run_step()
        given_up = [
            RequestOutput(
                seq.request_id, [], seq.finish_reason, seq.num_prompt_tokens, 0, error=error
            )
            for seq, error in self.scheduler.drain_failed()
        ]
        return given_up + [
            RequestOutput(
                out.seq.request_id,
                out.new_samples,
                out.seq.finish_reason,
                out.seq.num_prompt_tokens,
                out.seq.num_cached_tokens,
                first_output_prompt_logprobs(out.seq, len(out.new_samples)),
            )
            for out in outputs
        ]

    def generate(
        self,
        prompts: Iterable[list[int]],
        params: SamplingParams | list[SamplingParams],
        lora_names: list[str | None] | None = None,
    ) -> list[list[int]]:
        """Run prompts to completion together; returns each one's generated token ids.
        ``lora_names``: each prompt's adapter (None: the base model's)."""
        prompts = list(prompts)
        all_params = params if isinstance(params, list) else [params] * len(prompts)
        adapters = lora_names if lora_names is not None else [None] * len(prompts)
        ids = [
            self.add_request(p, sp, lora_name=name)
            for p, sp, name in zip(prompts, all_params, adapters, strict=True)
        ]
        tokens: dict[str, list[int]] = {request_id: [] for request_id in ids}
        while self.has_unfinished:
            for output in self.step():
                if output.request_id in tokens:
                    tokens[output.request_id].extend(s.token_id for s in output.new_samples)
        return [tokens[request_id] for request_id in ids]


def _rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank ``rank``'s device: the ``rank``-th GPU from the one configured, or the CPU."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def _serve_as_rank(
    config: EngineConfig, role: str | None, rank: int, port: int, pipe: Connection
) -> None:
    """A spawned rank's whole life: build its shard of the engine, then run rank 0's steps."""
    ignore_stop_signals()
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s tp-rank-{rank} %(levelname)s %(message)s"
    )
    engine = LLMEngine(config, role, tp_rank=rank, tp_port=port)
    with startup_objects_frozen():  # a collection's stall here stalls the whole group's step
        serve_steps(pipe, engine.runner.run_forward, FollowerRank(rank, engine.pool, pipe))


def _check_batch_invariant_rounding(model: LlamaForCausalLM) -> None:
    """Deterministic inference cannot serve inputs scaled per tensor at run time: one scale
    over the whole step's rows makes a request's rounding depend on the rows beside it."""
    for name, module in model.named_modules():
        if not isinstance(module, QuantizedLinear) or module.activations is None:
            continue
        if module.activations.strategy == DYNAMIC_PER_TENSOR:
            raise ValueError(
                f"--enable-deterministic-inference: {name} scales its inputs per tensor at "
                "run time, over the whole batch, so its answers depend on the batch"
            )
