"""Keep UCX (under NIXL) on the network interface of the worker's ``--host``.

UCX listens on every interface it finds, whatever address the worker was told to bind: a worker
meant for a private cluster network would also listen on the public one. Setting
``UCX_NET_DEVICES`` to the interface that holds ``--host``'s address before the first NIXL agent
starts keeps its TCP listeners there. RDMA ports (``/sys/class/infiniband``) stay in the list:
they open no TCP listener, and leaving them out would send GPU pages over TCP. Shared-memory
transports between workers of one host are not network devices and are unaffected. An
operator's own ``UCX_NET_DEVICES`` wins; a wildcard host (``0.0.0.0``) pins nothing.
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import struct
from pathlib import Path

logger = logging.getLogger(__name__)

UCX_NET_DEVICES = "UCX_NET_DEVICES"
_SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address
_WILDCARDS = {"", "0.0.0.0", "*"}
RDMA_DEVICES = Path("/sys/class/infiniband")


def ipv4_interfaces() -> dict[str, str]:
    """This machine's interfaces that have an IPv4 address: name -> address."""
    found = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                reply = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, request)
            except OSError:
                continue  # no IPv4 address on this interface
            found[name] = socket.inet_ntoa(reply[20:24])
    return found


def interface_of(host: str) -> str | None:
    """The name of the interface holding ``host``'s IPv4 address (a name is resolved first),
    or None if no interface of this machine has it."""
    try:
        address = socket.gethostbyname(host)
    except OSError:
        return None
    return next((name for name, a in ipv4_interfaces().items() if a == address), None)


def rdma_ports(root: Path | None = None) -> list[str]:
    """UCX's names (``device:port``) of this machine's RDMA ports."""
    root = RDMA_DEVICES if root is None else root
    if not root.is_dir():
        return []
    return sorted(
        f"{device.name}:{port.name}"
        for device in root.iterdir()
        if (device / "ports").is_dir()
        for port in (device / "ports").iterdir()
    )


def pin_ucx_to_host(host: str) -> str | None:
    """Set ``UCX_NET_DEVICES`` to ``host``'s interface (and the RDMA ports) unless it is set
    already or ``host`` is a wildcard; returns the value UCX will use (None: every device)."""
    if UCX_NET_DEVICES in os.environ:
        return os.environ[UCX_NET_DEVICES]
    if host in _WILDCARDS:
        return None
    name = interface_of(host)
    if name is None:
        logger.warning("no interface holds %s: UCX listens on every interface", host)
        return None
    os.environ[UCX_NET_DEVICES] = ",".join([name, *rdma_ports()])
    return os.environ[UCX_NET_DEVICES]
