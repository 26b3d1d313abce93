"""The adapters one engine serves: by name, in host memory and in the device's slots.

An adapter is registered by name and folder (``--lora-modules`` or a runtime load); it is read
and checked at once, so a bad one is refused before any request names it. Host memory keeps at
most ``--max-cpu-loras`` adapters' tensors, least recently used out first (an evicted one is
read from its folder again when next wanted); the device holds ``--max-loras`` of them in
slots, least recently used out first, written when a step needs an adapter that has none. The
scheduler lets at most ``--max-loras`` adapters run at once (``Scheduler.max_adapters``), so
every step's adapters fit.

An adapter that is wanted again after host memory let it go is read off the engine's thread
(``ready``): the scheduler sets its requests aside until it is in, and the steps of everyone
else go on meanwhile.

The engine's own thread alone calls a ``LoraManager``; its reader thread only reads files.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor

from common.config import LoraConfig, ModelConfig
from common.lora_adapters import adapter_namespace, check_adapter_name
from common.model.lora import LoraAdapter, LoraSlots, load_adapter

logger = logging.getLogger(__name__)


class LoraManager:
    def __init__(self, config: LoraConfig, model_config: ModelConfig, slots: LoraSlots) -> None:
        self.model_config = model_config
        self.max_rank = config.max_lora_rank
        self.host_capacity = config.host_capacity
        self.slots = slots
        self.paths: dict[str, str] = {}
        self.namespaces: dict[str, str] = {}
        self.host: OrderedDict[str, LoraAdapter] = OrderedDict()  # least recently used first
        self.slot_names: list[str | None] = [None] * slots.max_loras
        self._slot_order: OrderedDict[int, None] = OrderedDict(
            (i, None) for i in range(len(self.slot_names))
        )
        # Reads of adapters wanted again after host memory let them go (``ready``).
        self._reads: dict[str, Future[LoraAdapter]] = {}
        self._reader: ThreadPoolExecutor | None = None

    @property
    def names(self) -> list[str]:
        return sorted(self.paths)

    @property
    def max_loras(self) -> int:
        return self.slots.max_loras

    def add(self, name: str, path: str) -> None:
        """Serve adapter ``name`` from ``path``: read and checked now (``ValueError`` naming
        the problem, or that the name is taken)."""
        check_adapter_name(name)
        if name in self.paths:
            raise ValueError(f"LoRA adapter {name!r} is already loaded (from {self.paths[name]})")
        adapter = load_adapter(name, path, self.model_config, self.max_rank)
        self.namespaces[name] = adapter_namespace(name, path)
        self.paths[name] = path
        self._keep_on_host(adapter)
        logger.info(
            "LoRA adapter %s: rank %d over %s, from %s",
            name,
            adapter.rank,
            ", ".join(adapter.targets),
            path,
        )

    def remove(self, name: str) -> None:
        """Stop serving ``name``; the caller makes sure no request computes under it."""
        if name not in self.paths:
            raise ValueError(f"LoRA adapter {name!r} is not loaded")
        del self.paths[name], self.namespaces[name]
        self.host.pop(name, None)
        read = self._reads.pop(name, None)
        if read is not None:
            read.cancel()  # or, running, its result is never taken
        for slot, held in enumerate(self.slot_names):
            if held == name:
                self.slots.clear(slot)
                self.slot_names[slot] = None

    def namespace(self, name: str) -> str:
        """The prefix-cache namespace of ``name``'s requests (``ValueError`` if unknown)."""
        if name not in self.namespaces:
            raise ValueError(f"the LoRA adapter {name!r} does not exist")
        return self.namespaces[name]

    def ready(self, name: str) -> bool:
        """Whether a step may compute under ``name`` now: it is in host memory or in a device
        slot. If not, its read from its folder is started on the reader thread (unless on its
        way already) and False returned; a later call takes it in. ``ValueError`` if that read
        failed (the folder changed or went away since the adapter was loaded); a later call
        tries again."""
        if name in self.host or name in self.slot_names:
            return True
        read = self._reads.get(name)
        if read is None:
            if self._reader is None:
                self._reader = ThreadPoolExecutor(1, thread_name_prefix="lora-read")
            self._reads[name] = self._reader.submit(
                load_adapter, name, self.paths[name], self.model_config, self.max_rank
            )
            return False
        if not read.done():
            return False
        del self._reads[name]
        try:
            adapter = read.result()
        except (OSError, ValueError) as exc:
            raise ValueError(f"LoRA adapter {name!r} could not be read again: {exc}") from exc
        self._keep_on_host(adapter)
        return True

    def slots_for(self, names: Iterable[str]) -> dict[str, int]:
        """A device slot holding each adapter of ``names`` (at most ``max_loras`` of them),
        writing those that hold none into the least recently used slots of adapters not
        among ``names``."""
        wanted = set(names)
        if len(wanted) > self.max_loras:
            raise ValueError(f"{len(wanted)} adapters in one step, more than --max-loras")
        placed = {name: slot for slot, name in enumerate(self.slot_names) if name in wanted}
        for name in sorted(wanted - placed.keys()):
            slot = next(s for s in self._slot_order if self.slot_names[s] not in wanted)
            self.slots.load(slot, self._host_adapter(name))
            self.slot_names[slot] = name
            placed[name] = slot
        for slot in placed.values():
            self._slot_order.move_to_end(slot)
        return placed

    def _host_adapter(self, name: str) -> LoraAdapter:
        adapter = self.host.get(name)
        if adapter is None:
            # Rare: the scheduler admits a request once its adapter is in (``ready``), so only
            # one that waited in the running set while its slot and host copy went is read here.
            logger.warning("LoRA adapter %s is read again on the step thread", name)
            adapter = load_adapter(name, self.paths[name], self.model_config, self.max_rank)
            self._keep_on_host(adapter)
        self.host.move_to_end(name)
        return adapter

    def _keep_on_host(self, adapter: LoraAdapter) -> None:
        self.host[adapter.name] = adapter
        self.host.move_to_end(adapter.name)
        while len(self.host) > self.host_capacity:
            self.host.popitem(last=False)

    def on_device(self) -> list[str]:
        return sorted(name for name in self.slot_names if name is not None)

    def on_host(self) -> list[str]:
        return sorted(self.host)
