"""Prometheus metrics of KV transfers, labelled by backend (zmq|nixl) and side (sender|receiver).

Failure reasons are a closed set (the ``Failure`` names below) so label cardinality stays bounded.
"""

from __future__ import annotations

from prometheus_client import Counter, Histogram

SENDER = "sender"
RECEIVER = "receiver"

TRANSFER_BYTES = Counter(
    "pdserve_kv_transfer_bytes",
    "KV bytes moved (pages and scales), counted once per side when a transfer completes",
    ["backend", "side"],
)
TRANSFER_PAGES = Counter(
    "pdserve_kv_transfer_pages",
    "KV pages moved, counted once per side when a transfer completes",
    ["backend", "side"],
)
TRANSFER_SECONDS = Histogram(
    "pdserve_kv_transfer_seconds",
    "Receiver: start_fetch to pages in place. Sender: fetch request to acknowledgement",
    ["backend", "side"],
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
TRANSFER_FAILURES = Counter(
    "pdserve_kv_transfer_failures",
    "Transfers that ended without the pages being delivered, by reason",
    ["backend", "side", "reason"],
)
BAD_MESSAGES = Counter(
    "pdserve_kv_transfer_bad_messages",
    "Side-channel frames dropped as malformed, oversized, unknown or unexpected",
    ["backend", "side"],
)


class Failure:
    """The reasons a transfer can fail, as used in the failures counter."""

    TIMEOUT = "timeout"  # receiver deadline passed
    LEASE_EXPIRED = "lease_expired"  # sender lease ended before an acknowledgement
    ABORTED = "aborted"
    HANDSHAKE = "handshake"  # version, layout, backend or engine mismatch
    SENDER_REFUSED = "sender_refused"  # TransferFailed from the sender
    RECEIVER_GAVE_UP = "receiver_gave_up"  # ReleasePages(ok=False) from the receiver
    TRANSPORT = "transport"  # NIXL/UCX error, malformed page data
