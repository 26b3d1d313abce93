"""UCX under NIXL stays on the interface of the worker's --host."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from optional_backends import needs_nixl

from kvtransfer import ucx_interface
from kvtransfer.ucx_interface import (
    UCX_NET_DEVICES,
    interface_of,
    ipv4_interfaces,
    pin_ucx_to_host,
)

pytestmark = pytest.mark.slow  # NIXL agents in processes

# A child that pins UCX to 127.0.0.1 (or not), starts a NIXL agent and prints the addresses its
# TCP sockets listen on, read from /proc (no ss needed).
LISTENERS = """
import json, os, socket, struct, sys
from kvtransfer.ucx_interface import pin_ucx_to_host
if sys.argv[1] == "pin":
    pin_ucx_to_host("127.0.0.1")
from kvtransfer.nixl_backend import create_agent
agent = create_agent("listener-probe")
inodes = set()
for fd in os.listdir("/proc/self/fd"):
    try:
        target = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        continue
    if target.startswith("socket:["):
        inodes.add(target[8:-1])
found = []
for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
    for line in open(table).read().splitlines()[1:]:
        fields = line.split()
        if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
            continue
        raw = bytes.fromhex(fields[1].split(":")[0])
        if width == 8:
            found.append(socket.inet_ntoa(raw[::-1]))
        else:
            words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
            found.append(socket.inet_ntop(socket.AF_INET6, words))
print(json.dumps(found))
"""


def test_interface_of_an_address():
    assert interface_of("127.0.0.1") == "lo"
    assert interface_of("localhost") == "lo"
    assert interface_of("203.0.113.9") is None  # TEST-NET-3: no interface here has it
    assert interface_of("no-such-host.invalid") is None


def test_pin_sets_the_interface_and_keeps_rdma_ports(monkeypatch, tmp_path):
    monkeypatch.delenv(UCX_NET_DEVICES, raising=False)
    for device, ports in (("mlx5_0", ["1"]), ("mlx5_1", ["1", "2"])):
        for port in ports:
            (tmp_path / device / "ports" / port).mkdir(parents=True)
    monkeypatch.setattr(ucx_interface, "RDMA_DEVICES", tmp_path)
    assert pin_ucx_to_host("0.0.0.0") is None  # a wildcard host pins nothing
    assert UCX_NET_DEVICES not in os.environ
    assert pin_ucx_to_host("127.0.0.1") == "lo,mlx5_0:1,mlx5_1:1,mlx5_1:2"
    monkeypatch.setenv(UCX_NET_DEVICES, "eth7")  # the operator's choice wins
    assert pin_ucx_to_host("127.0.0.1") == "eth7"


def listeners(mode: str) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != UCX_NET_DEVICES}
    result = subprocess.run(
        [sys.executable, "-c", LISTENERS, mode],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@needs_nixl
def test_a_pinned_nixl_agent_listens_on_loopback_only():
    pinned = listeners("pin")
    assert pinned and all(address in ("127.0.0.1", "::1") for address in pinned), pinned
    if not any(name != "lo" for name in ipv4_interfaces()):
        pytest.skip("this machine has no interface but loopback: nothing to compare with")
    # Unpinned, the same agent also listens elsewhere: the pin is what keeps it in.
    assert any(address not in ("127.0.0.1", "::1") for address in listeners("all"))
