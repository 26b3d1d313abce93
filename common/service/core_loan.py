"""Cores a worker lends the worker beside it while it has nothing to run.

Without a GPU `pdserve up` pins each worker to cores of its own (``pdserve/launcher.py``): two
workers' threads on one core slow each other down many times over. But a prefill worker waits
between prompts and a decode worker between requests, and an idle core is arithmetic and memory
bandwidth the other could use: on the 2-core AMX Xeon a decode step of SmolLM2 at batch 8 x 256
took 16 ms on two cores against 29 ms on one (its weights are read at twice the rate). So the
launcher pairs a prefill worker with a decode worker, and each runs its forward on the other's
cores too while the other has no work, giving them back at its next layer once the other has.

The pair share a file of two flags, one per side (``create_loan_file``): each worker marks itself
busy while it has work and idle while it waits (``mark_busy``), and its forward reads the
partner's flag before every layer (``before_layer``). OpenMP's places (``omp_places``) bind the
worker's first threads to its own cores and the next ones to its partner's, so a forward of more
threads than its own cores runs the extra ones on the lent cores and only there.

pdserve's own kernels split their work by rows, columns or heads, never within a sum, so a
forward made of them gives the same bits on any number of threads: a bf16 model's, and every
model's in deterministic mode (``tests/test_core_loan.py`` checks a step's logits both ways).
A float32 model's GEMMs may go through MKL instead, which splits them as it likes: there a last
bit may move with the lent cores, as it does with the batch around a row. Sampling always runs
on the worker's own threads (``after_layers``).
"""

from __future__ import annotations

import argparse
import mmap
import os

from prometheus_client import Counter, Gauge

# One flag byte a side: 1 while that worker has work, 0 while it waits.
LOAN_FILE_BYTES = 2
_BUSY, _IDLE = 1, 0

LENT_CORES_IN_USE = Gauge(
    "pdserve_lent_cores_in_use",
    "Cores of the paired worker (pdserve up without a GPU) this worker's forward runs on now, "
    "lent while that worker has no work",
)
LAYERS_ON_LENT_CORES = Counter(
    "pdserve_layers_on_lent_cores",
    "Forward layers this worker ran with the paired worker's cores beside its own",
)


def create_loan_file(path: str) -> None:
    """The pair's flags, both busy: neither lends its cores before it says it is waiting (a
    worker loading its model is busy)."""
    with open(path, "wb") as flags:
        flags.write(bytes([_BUSY] * LOAN_FILE_BYTES))


def omp_places(own: set[int], lent: set[int]) -> str:
    """OMP_PLACES for a worker on ``own`` cores that may borrow ``lent``: its own first, so that
    its first threads (the main one included) stay on them."""
    return ",".join(f"{{{core}}}" for core in [*sorted(own), *sorted(lent)])


def add_core_loan_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("core loan (set by pdserve up)")
    group.add_argument(
        "--core-loan",
        default=None,
        help="the flags file this worker shares with the worker whose cores it may borrow",
    )
    group.add_argument(
        "--core-loan-side", type=int, choices=[0, 1], default=0, help="this worker's flag"
    )
    group.add_argument(
        "--lent-cores",
        type=int,
        default=0,
        help="the partner's cores: extra threads this worker's forward runs while it waits",
    )


class CoreLoan:
    """One worker's side of a pair: its own flag, its partner's, and the thread count of its
    forward's next layer (``LlamaForCausalLM.layer_threads``)."""

    def __init__(self, path: str, side: int, own_threads: int, lent_threads: int) -> None:
        if side not in (0, 1):
            raise ValueError(f"a core loan has sides 0 and 1, not {side}")
        if own_threads < 1 or lent_threads < 1:
            raise ValueError("a core loan needs at least one core on each side")
        with open(path, "r+b") as flags:
            self._flags = mmap.mmap(flags.fileno(), LOAN_FILE_BYTES)
        self.side, self.partner = side, 1 - side
        self.own_threads, self.lent_threads = own_threads, lent_threads
        self._busy: bool | None = None
        # torch is imported here, not at the top: `pdserve up` writes the loan files with this
        # module's helpers before it starts the workers, and does not import torch for that.
        import torch

        self._set_num_threads = torch.set_num_threads
        self._threads = torch.get_num_threads()
        self.mark_busy(True)  # until this worker's loop says it waits

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> CoreLoan | None:
        """The worker's side of the loan its flags name; None without ``--core-loan``. A flag
        file that is missing or of another size, or no ``--lent-cores``, is a ValueError."""
        if args.core_loan is None:
            return None
        if args.lent_cores < 1:
            raise ValueError("--core-loan needs --lent-cores, the partner's core count")
        try:
            size = os.path.getsize(args.core_loan)
        except OSError as exc:
            raise ValueError(f"--core-loan {args.core_loan}: {exc.strerror}") from exc
        if size != LOAN_FILE_BYTES:
            raise ValueError(
                f"--core-loan {args.core_loan} holds {size} bytes, not a pair's "
                f"{LOAN_FILE_BYTES} flags"
            )
        import torch

        return cls(args.core_loan, args.core_loan_side, torch.get_num_threads(), args.lent_cores)

    def mark_busy(self, busy: bool) -> None:
        """Say whether this worker has work: while it has none, its partner runs on its cores."""
        if busy != self._busy:
            self._flags[self.side] = _BUSY if busy else _IDLE
            self._busy = busy

    def partner_waiting(self) -> bool:
        return self._flags[self.partner] == _IDLE

    def before_layer(self) -> None:
        """The next layer's threads: the partner's cores beside this worker's own while the
        partner waits, this worker's own alone once it has work."""
        borrowing = self.partner_waiting()
        self._run_on(self.own_threads + (self.lent_threads if borrowing else 0))
        if borrowing:
            LAYERS_ON_LENT_CORES.inc()

    def after_layers(self) -> None:
        """Back to this worker's own threads once the layers are done: the head and sampling
        after them run there, whatever the partner does."""
        self._run_on(self.own_threads)

    def _run_on(self, threads: int) -> None:
        if threads != self._threads:
            self._set_num_threads(threads)
            self._threads = threads
            LENT_CORES_IN_USE.set(threads - self.own_threads)

    def close(self) -> None:
        self._flags.close()
