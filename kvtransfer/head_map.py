"""Which prefill rank serves which KV heads to a decode rank, when the two workers are split
over different tensor-parallel sizes.

Each rank of a tensor-parallel worker holds a run of the model's KV heads
(``common/model/parallel.py``: a slice, or one head replicated on neighbouring ranks when there
are more ranks than heads). A decode rank needs exactly its own run; it takes each head from the
first prefill rank that holds it, so prefill rank 0 always serves decode rank 0's first head
(the fetch that holds the lease, see ``kvtransfer/tp_group.py``), and adjacent heads held by one
rank come in one fetch. A pure function, tested without sockets.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class HeadSource:
    """Model KV heads ``heads`` come from source ``source`` (an index into the holders)."""

    source: int
    heads: range


def plan_heads(wanted: range, holders: list[range]) -> list[HeadSource]:
    """The fetches that bring ``wanted`` (model KV heads) from sources holding ``holders``:
    one per run of heads taken from one source, in head order.

    Raises ValueError naming the heads no source holds (a layout that cannot be served)."""
    if not wanted or wanted.step != 1:
        raise ValueError(f"a decode rank must want a run of KV heads, got {wanted!r}")
    plan: list[HeadSource] = []
    missing = []
    for head in wanted:
        source = next((i for i, held in enumerate(holders) if head in held), None)
        if source is None:
            missing.append(head)
        elif plan and plan[-1].source == source and plan[-1].heads.stop == head:
            plan[-1] = HeadSource(source, range(plan[-1].heads.start, head + 1))
        else:
            plan.append(HeadSource(source, range(head, head + 1)))
    if missing:
        held = ", ".join(f"{r.start}-{r.stop - 1}" for r in holders) or "none"
        raise ValueError(f"KV heads {missing} are held by no prefill rank (they hold {held})")
    return plan
