"""pdserve's version, for ``/version`` and the start-up logs."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import tomllib

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def pdserve_version() -> str:
    """The installed distribution's version, else the version in the checkout's pyproject.toml.

    A checkout put on ``PYTHONPATH`` without being installed (as the GPU check runs it) has no
    distribution metadata; its router must still start, and say the version it was cut from.
    """
    try:
        return importlib.metadata.version("pdserve")
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        with PYPROJECT.open("rb") as file:
            return str(tomllib.load(file)["project"]["version"])
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        return "unknown"
