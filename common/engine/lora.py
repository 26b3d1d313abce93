"""The adapters one engine serves: by name, in host memory and in the device's slots.

An adapter is registered by name and folder (``--lora-modules`` or a runtime load); it is read
and checked at once, so a bad one is refused before any request names it. Host memory keeps at
most ``--max-cpu-loras`` adapters' tensors, least recently used out first (an evicted one is
read from its folder again when next wanted); the device holds ``--max-loras`` of them in
slots, least recently used out first, written when a step needs an adapter that has none. The
scheduler lets at most ``--max-loras`` adapters run at once (``Scheduler.max_adapters``), so
every step's adapters fit.

A runtime load (``start_add``) and an adapter wanted again after host memory let it go
(``ready``) are read off the engine's thread: the load is answered, or the requests under the
adapter set aside by the scheduler go on, once the files are in, and the steps of everyone else
go on meanwhile.

The engine's own thread alone calls a ``LoraManager``; its reader thread only reads files.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from common.config import LoraConfig, ModelConfig
from common.lora_adapters import adapter_namespace, check_adapter_name
from common.model.lora import LoraAdapter, LoraSlots, load_adapter

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _PendingAdd:
    """A runtime load being read: its folder, the read, and the operations it answers."""

    path: str
    read: Future[LoraAdapter]
    operation_ids: list[str]


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
        # Reads of adapters wanted again after host memory let them go (``ready``), and of
        # runtime loads (``start_add``), on one reader thread made at the first.
        self._reads: dict[str, Future[LoraAdapter]] = {}
        self._adds: dict[str, _PendingAdd] = {}
        self._answered: list[tuple[str, str | None]] = []
        self._reader: ThreadPoolExecutor | None = None

    @property
    def names(self) -> list[str]:
        return sorted(self.paths)

    @property
    def max_loras(self) -> int:
        return self.slots.max_loras

    def add(self, name: str, path: str) -> None:
        """Serve adapter ``name`` from ``path``: read and checked now (``ValueError`` naming
        the problem, or that the name is taken). For adapters given at start."""
        self._check_free(name)
        self._serve(name, path, load_adapter(name, path, self.model_config, self.max_rank))

    def start_add(self, name: str, path: str, operation_id: str) -> None:
        """Serve adapter ``name`` from ``path`` once its files, read on the reader thread, are
        taken in by ``finish_adds``, which then answers ``operation_id``. A runtime load: the
        engine's steps go on meanwhile. ``ValueError`` at once for a bad name, or one taken or
        being loaded from another folder; the same folder again is done already."""
        if self.paths.get(name) == path:
            self._answered.append((operation_id, None))
            return
        pending = self._adds.get(name)
        if pending is not None:
            if pending.path != path:
                raise ValueError(f"LoRA adapter {name!r} is being loaded from {pending.path}")
            pending.operation_ids.append(operation_id)
            return
        self._check_free(name)
        read = self._read(name, path)
        self._adds[name] = _PendingAdd(path, read, [operation_id])

    def finish_adds(self) -> list[tuple[str, str | None]]:
        """``(operation_id, None or why it failed)`` of each runtime load finished since the
        last call; those whose files were read are served from now on."""
        answers, self._answered = self._answered, []
        for name, pending in list(self._adds.items()):
            if not pending.read.done():
                continue
            del self._adds[name]
            try:
                self._serve(name, pending.path, pending.read.result())
                error = None
            except Exception as exc:  # a bad file is refused, whatever the reader raised
                error = str(exc) or type(exc).__name__
            answers += [(operation_id, error) for operation_id in pending.operation_ids]
        return answers

    @property
    def adding(self) -> bool:
        """Whether a runtime load is being read."""
        return bool(self._adds)

    def _check_free(self, name: str) -> None:
        check_adapter_name(name)
        if name in self.paths:
            raise ValueError(f"LoRA adapter {name!r} is already loaded (from {self.paths[name]})")

    def _read(self, name: str, path: str) -> Future[LoraAdapter]:
        if self._reader is None:
            self._reader = ThreadPoolExecutor(1, thread_name_prefix="lora-read")
        return self._reader.submit(load_adapter, name, path, self.model_config, self.max_rank)

    def _serve(self, name: str, path: str, adapter: LoraAdapter) -> None:
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
            self._reads[name] = self._read(name, self.paths[name])
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
