"""A mixture of experts' decode step beside its floor: the weights the step's tokens chose.

A decode step of a dense model reads every weight once; a mixture's reads only the experts its
tokens chose in each layer (``common/model/moe.py`` gathers each expert's tokens and skips the
rest), so its floor is the attention, router, head and shared weights plus, per layer, the
experts chosen, counted in the very steps timed. Weights are random (``--load-format dummy``)
of a real shape from ``benchmarks/shapes/``, Qwen3-30B-A3B's by default (128 experts of width
768, 8 per token); on a CPU a few of its layers (``--layers``), since its 61 GB do not fit.
Printed per batch size, e.g.::

    batch  1: 41.2 ms/step; 8.0 of 128 experts a layer, 0.79 GB read: floor 27.6 ms (1.49x)

On the CPU the floor is a streaming read of that many bytes on the same core, timed beside
each case (the fastest of the run counts); on CUDA the bytes over the device's copy bandwidth.

    python -m benchmarks.step.moe [--shape benchmarks/shapes/Mixtral-8x7B] [--layers 4]
        [--batch-sizes 1,8] [--context 256] [--steps 16] [--core 0] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.harness import add_core_argument, memory_read_seconds, pin_to_cores, random_prompts
from benchmarks.step.moe_weights import weight_bytes
from benchmarks.step.real_shape import copy_bandwidth
from common.config import CacheConfig, EngineConfig, SchedulerConfig
from common.engine.llm_engine import LLMEngine
from common.model.moe import SparseMoE, route
from common.sampling_params import SamplingParams

SHAPES = Path(__file__).resolve().parent.parent / "shapes"


def shape_with_layers(shape: Path, layers: int | None, scratch: Path) -> Path:
    """A folder holding ``shape``'s config.json, cut to its first ``layers`` layers."""
    config = json.loads((shape / "config.json").read_text())
    if layers is not None:
        config["num_hidden_layers"] = min(layers, config["num_hidden_layers"])
    folder = scratch / shape.name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return folder


class ExpertCounter:
    """Counts, per forward, the distinct experts each MoE layer's tokens chose: hooks on the
    routers see the logits the layer routes by."""

    def __init__(self, engine: LLMEngine) -> None:
        self.per_forward: list[list[int]] = []
        self._current: list[int] = []
        for layer in engine.model.decoder_layers():
            mlp = layer.mlp
            if isinstance(mlp, SparseMoE):
                mlp.gate.register_forward_hook(self._hook(mlp))

    def _hook(self, mlp: SparseMoE):
        def count(_module, _inputs, logits: torch.Tensor) -> None:
            _, chosen = route(logits, mlp.moe.top_k, mlp.moe.renormalize)
            self._current.append(int(chosen.unique().numel()))

        return count

    def step_done(self) -> None:
        self.per_forward.append(self._current)
        self._current = []

    def reset(self) -> None:
        self.per_forward, self._current = [], []


def decode_steps(
    engine: LLMEngine, counter: ExpertCounter, batch: int, context: int, steps: int
) -> tuple[float, list[float]]:
    """Median seconds of an engine step while ``batch`` sequences decode at ``context`` tokens,
    and the mean distinct experts per sparse layer over those steps."""
    params = SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True)
    vocab = engine.model_config.vocab_size
    for prompt in random_prompts(batch, context, vocab, seed=batch):
        engine.add_request(prompt, params)
    while engine.scheduler.waiting or any(
        s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running
    ):
        engine.step()
    counter.reset()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        if engine.device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        counter.step_done()
    while engine.has_unfinished:
        engine.step()
    layers = len(counter.per_forward[0])
    means = [statistics.mean(step[i] for step in counter.per_forward) for i in range(layers)]
    return statistics.median(times), means


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", type=Path, default=SHAPES / "Qwen3-30B-A3B")
    parser.add_argument("--layers", type=int, default=None, help="default: all on CUDA, 4 on CPU")
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5, help="reads timed per floor")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    add_core_argument(parser)
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cpu":
        pin_to_cores({args.core})
    layers = args.layers if args.layers is not None or device.type == "cuda" else 4
    scratch = tempfile.TemporaryDirectory()
    folder = shape_with_layers(args.shape, layers, Path(scratch.name))
    engine = LLMEngine(
        EngineConfig(
            model=str(folder),
            dtype="bfloat16",
            device=args.device,
            load_format="dummy",
            cache=CacheConfig(kv_cache_memory=1 << 30),
            scheduler=SchedulerConfig(max_num_batched_tokens=2048, max_model_len=2048),
        )
    )
    config = engine.model_config
    assert config.moe is not None, f"{args.shape} is not a mixture of experts"
    counter = ExpertCounter(engine)
    itemsize = engine.dtype.itemsize
    everything = weight_bytes(
        config, itemsize, [config.moe.num_experts] * len(config.moe.sparse_layers)
    )
    where = f"one core (#{args.core})" if device.type == "cpu" else torch.cuda.get_device_name()
    print(
        f"{args.shape.name}: {config.num_layers} layers of {config.moe.num_experts} experts "
        f"(width {config.moe.expert_intermediate_size}, {config.moe.top_k} a token), "
        f"{everything / 1e9:.2f} GB of bf16 weights, random; {where}"
    )
    bandwidth = copy_bandwidth(device) if device.type == "cuda" else None
    rows = []
    with torch.inference_mode():
        for batch in (int(b) for b in args.batch_sizes.split(",")):
            seconds, per_layer = decode_steps(engine, counter, batch, args.context, args.steps)
            active = weight_bytes(config, itemsize, per_layer)
            if bandwidth is None:
                floor = memory_read_seconds(int(active), args.repeats)
            else:
                floor = active / bandwidth
            rows.append((batch, seconds, statistics.mean(per_layer), active, floor))
    for batch, seconds, mean_experts, active, floor in rows:
        print(
            f"batch {batch:2d}: {seconds * 1e3:.1f} ms/step; {mean_experts:.1f} of "
            f"{config.moe.num_experts} experts a layer, {active / 1e9:.2f} GB read: floor "
            f"{floor * 1e3:.1f} ms ({seconds / floor:.2f}x)"
        )
    scratch.cleanup()


if __name__ == "__main__":
    main()
