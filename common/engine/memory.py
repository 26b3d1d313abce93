"""Sizes the KV pool from a memory budget, after a warm-up forward has shown peak activations."""

from __future__ import annotations

import logging
import os

import torch

from common.config import EngineConfig
from common.engine.kv_pool import KVPool
from common.kv_layout import KVLayout
from common.model.llama import LlamaForCausalLM
from kernels.interface import AttentionBackend, AttentionMetadata
from kernels.sizes import ceil_div

logger = logging.getLogger(__name__)

# Without a GPU the pool lives in host memory beside everything else; without --kv-cache-memory it
# takes this much, or a quarter of the memory available now if that is less.
DEFAULT_CPU_KV_CACHE_BYTES = 2 << 30


def parse_memory_size(text: str) -> int:
    """'4GiB', '512MiB', '1.5GB', '1000000' -> bytes."""
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
    units |= {"KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}
    cleaned = text.strip().upper()
    number = cleaned.rstrip("KMGTIB")
    unit = cleaned[len(number) :]
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if unit not in units or value <= 0:
        raise ValueError(f"cannot read memory size {text!r}; write e.g. 4GiB, 512MiB or 1e9")
    return int(value * units[unit])


@torch.inference_mode()
def warm_up(
    model: LlamaForCausalLM, layout: KVLayout, num_tokens: int, backend: AttentionBackend
) -> None:
    """One forward of ``num_tokens`` prompt tokens through a scratch pool, then one of a decode
    token over them (the model stays bound to the pool: bind the real pool afterwards). Both
    run with ``backend`` launching every variant of its kernels, so that on a GPU each is
    compiled here: a prefill worker decodes too, a lone token over a cached prompt."""
    device = model.device
    num_pages = ceil_div(num_tokens, layout.page_size)
    pool = KVPool(layout, num_pages, device)
    model.bind_kv(pool, backend)
    page_tables = torch.arange(num_pages, dtype=torch.int32, device=device)[None]
    seq_lens = torch.tensor([num_tokens], dtype=torch.int32, device=device)
    last = torch.tensor([num_tokens - 1], device=device)
    with backend.launching_every_variant():
        # The prompt, ``num_tokens`` query rows.
        meta = AttentionMetadata(
            query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=device),
            seq_lens=seq_lens,
            page_tables=page_tables,
            slot_mapping=torch.arange(num_tokens, dtype=torch.int64, device=device),
            max_query_len=num_tokens,
            max_seq_len=num_tokens,
        )
        tokens = torch.zeros(num_tokens, dtype=torch.long, device=device)
        positions = torch.arange(num_tokens, device=device)
        model(tokens, positions, meta, last)
        # Its last token again, as a decode step: one query row over the whole prompt.
        meta = AttentionMetadata(
            query_start_loc=torch.tensor([0, 1], dtype=torch.int32, device=device),
            seq_lens=seq_lens,
            page_tables=page_tables,
            slot_mapping=last,
            max_query_len=1,
            max_seq_len=num_tokens,
        )
        model(tokens[:1], last, meta, torch.tensor([0], device=device))


def warms_up(config: EngineConfig, device: torch.device) -> bool:
    """Whether an engine's start-up runs ``warm_up``: to measure a forward's activations where
    the pool is sized from memory, and on CUDA always, where it compiles the kernels."""
    return config.cache.num_pages is None or device.type == "cuda"


def graph_memory(warm_up_activations: int, graph_batch: int, vocab_size: int) -> int:
    """Bytes to keep for CUDA graphs of decode batches of up to ``graph_batch`` rows. Their
    memory pool is their own, so the eager forwards' cached blocks do not serve them: at most a
    warm-up forward's activations (it runs at least as many tokens), plus each row's logits in
    the model's dtype, in float32, and the copy a replay hands out (the warm-up computes
    logits for one row)."""
    if graph_batch <= 0:
        return 0
    return warm_up_activations + graph_batch * vocab_size * (2 + 4 + 4)


def _available_host_memory() -> int:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def plan_num_pages(
    model: LlamaForCausalLM,
    layout: KVLayout,
    config: EngineConfig,
    device: torch.device,
    backend: AttentionBackend,
    max_model_len: int,
    extra_bytes_per_page: int = 0,
    graph_batch: int = 0,
) -> int:
    """Pages for the KV pool; ``extra_bytes_per_page`` is what each page costs besides the
    target's own (a draft model's page of the same id). ``graph_batch``: the largest decode
    batch CUDA graphs will be captured for, whose memory the graphs keep to themselves."""
    cache = config.cache
    warm_tokens = min(config.scheduler.token_budget, max_model_len)
    if cache.num_pages is not None:
        num_pages = cache.num_pages
        if warms_up(config, device):
            # Nothing to measure, but the forwards still compile the Triton kernels a worker
            # runs, which would otherwise compile in front of the first request.
            warm_up(model, layout, warm_tokens, backend)
    else:
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
            resident = torch.cuda.memory_allocated(device)
            warm_up(model, layout, warm_tokens, backend)
            peak = torch.cuda.max_memory_allocated(device)
            total = torch.cuda.get_device_properties(device).total_memory
            graphs = graph_memory(peak - resident, graph_batch, model.config.vocab_size)
            budget = cache.kv_cache_memory or (
                int(total * cache.gpu_memory_utilization) - peak - graphs
            )
            logger.info(
                "warm-up peak %.2f GiB of %.2f GiB%s",
                peak / 2**30,
                total / 2**30,
                f", {graphs / 2**30:.2f} GiB kept for CUDA graphs" if graphs else "",
            )
        else:
            warm_up(model, layout, warm_tokens, backend)
            available = _available_host_memory()
            budget = cache.kv_cache_memory or min(DEFAULT_CPU_KV_CACHE_BYTES, available // 4)
            if budget > available:
                raise ValueError(
                    f"--kv-cache-memory asks for {budget / 2**30:.2f} GiB but only "
                    f"{available / 2**30:.2f} GiB of host memory is available"
                )
        num_pages = budget // (layout.bytes_per_page + extra_bytes_per_page)
    if num_pages * layout.page_size < max_model_len:
        raise ValueError(
            f"the KV cache holds {num_pages * layout.page_size} tokens, less than one "
            f"sequence of the maximum model length {max_model_len}: give it more memory "
            "(--kv-cache-memory) or lower --max-model-len"
        )
    return num_pages
