"""Without a cluster secret, a process whose internal sockets bind anything but loopback does not
start, unless told ``--insecure-no-auth`` (and then it warns)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from common import cluster_auth
from common.cluster_auth import INSECURE_FLAG, SECRET_ENV, is_loopback, secret_for_binding
from common.model.default_model import resolve_model_path

SECRET = "correct horse battery staple"


@pytest.mark.parametrize(
    "bind",
    ["127.0.0.1", "127.3.4.5", "localhost", "::1", "tcp://127.0.0.1:8001", "tcp://[::1]:5",
     "tcp://localhost:0", "ipc:///tmp/pdserve.sock", "inproc://x"],
)  # fmt: skip
def test_loopback_binds(bind):
    assert is_loopback(bind)


@pytest.mark.parametrize(
    "bind",
    ["0.0.0.0", "::", "*", "", "10.1.2.3", "tcp://0.0.0.0:8001", "tcp://*:8001",
     "tcp://172.28.0.10:8001", "tcp://eth0:8001", "no-such-host.invalid"],
)  # fmt: skip
def test_binds_reachable_from_elsewhere(bind):
    assert not is_loopback(bind)


def test_no_secret_off_loopback_is_refused_naming_the_flag(monkeypatch, tmp_path):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    assert secret_for_binding(None, ["127.0.0.1", "tcp://127.0.0.1:1"], False) is None
    with pytest.raises(ValueError, match="--cluster-secret-file") as info:
        secret_for_binding(None, ["127.0.0.1", "0.0.0.0"], False)
    assert INSECURE_FLAG in str(info.value) and "0.0.0.0" in str(info.value)
    # A secret, from the environment or a file, is all it takes.
    monkeypatch.setenv(SECRET_ENV, SECRET)
    assert secret_for_binding(None, ["0.0.0.0"], False) == SECRET
    monkeypatch.delenv(SECRET_ENV)
    path = tmp_path / "secret"
    path.write_text(SECRET + "\n")
    assert secret_for_binding(str(path), ["0.0.0.0"], False) == SECRET


def test_insecure_no_auth_starts_open_with_a_warning(monkeypatch, caplog):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    with caplog.at_level(logging.WARNING, logger=cluster_auth.__name__):
        assert secret_for_binding(None, ["tcp://0.0.0.0:8001"], True) is None
    assert "WITHOUT AUTHENTICATION" in caplog.text and "tcp://0.0.0.0:8001" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=cluster_auth.__name__):
        secret_for_binding(None, ["127.0.0.1"], True)  # loopback: nothing more to say
    assert "WITHOUT AUTHENTICATION" not in caplog.text


@pytest.mark.slow
@pytest.mark.parametrize(
    "command",
    [
        ["router", "--model", str(resolve_model_path(None)), "--control", "tcp://0.0.0.0:1"],
        ["decode_worker", "--router", "tcp://127.0.0.1:1", "--host", "0.0.0.0"],
    ],
)
def test_processes_bound_off_loopback_refuse_to_start_without_a_secret(command):
    """Checked before anything is bound or loaded: the process exits at once, saying why."""
    env = {k: v for k, v in os.environ.items() if k != SECRET_ENV}
    done = subprocess.run(
        [sys.executable, "-m", *command], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    assert "--cluster-secret-file" in done.stderr and INSECURE_FLAG in done.stderr
