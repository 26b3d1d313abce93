"""A GGUF file served as it is: a small folder of its metadata, the weights left in the file.

pdserve reads a model's config and tokenizer from a Hugging Face folder, so a GGUF file gets
one, written once into the cache: config.json, generation_config.json and the tokenizer files
(chat template included), plus ``gguf_weights.json`` naming the file its weights are in. No
weight is dequantized: the engine reads them from the file (``common/model/gguf_weights.py``).

The folder is keyed by the file's absolute path, size and modification time, so an edited or
replaced file gets a folder of its own; a folder whose file changed later refuses to be loaded.
Nothing heavier than the standard library is imported until a folder has to be written, so
the router resolves an existing folder cheaply.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from common.model.model_cache import cache_dir, publish_once

WEIGHTS_MARKER = "gguf_weights.json"
# Bump when the folder's contents change, so folders written by an older pdserve are redone.
_FORMAT_VERSION = 1


@dataclass(frozen=True, slots=True)
class _FileIdentity:
    """Which file, as it was when its metadata was read."""

    path: str
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, path: Path) -> _FileIdentity:
        stat = path.stat()
        return cls(path=str(path), size=stat.st_size, mtime_ns=stat.st_mtime_ns)


def gguf_model_folder(gguf_path: str | os.PathLike[str]) -> Path:
    """The metadata folder of the GGUF file at `gguf_path`, written into the cache the first
    time (safe for processes starting together: one writes, the others reuse its folder)."""
    path = Path(gguf_path).expanduser().resolve()
    if not path.is_file():
        raise ValueError(f"GGUF file {str(path)!r} does not exist")
    identity = _FileIdentity.of(path)
    key = hashlib.sha256(json.dumps(asdict(identity)).encode()).hexdigest()[:16]
    dest = cache_dir() / "gguf" / f"{path.stem}-{key}"
    return publish_once(
        dest, lambda staging: _write_folder(identity, staging), _FORMAT_VERSION, source=str(path)
    )


def gguf_weights_file(folder: str | os.PathLike[str]) -> Path | None:
    """The GGUF file `folder`'s weights are in, or None for an ordinary model folder.

    Raises ValueError when the file is gone or is no longer the one the folder describes.
    """
    marker = Path(folder) / WEIGHTS_MARKER
    if not marker.is_file():
        return None
    try:
        identity = _FileIdentity(**json.loads(marker.read_text()))
    except (OSError, ValueError, TypeError) as exc:
        raise ValueError(f"cannot read {marker}: {exc}") from exc
    path = Path(identity.path)
    if not path.is_file():
        raise ValueError(
            f"model folder {str(folder)!r} takes its weights from {identity.path}, which no "
            "longer exists; resolve the GGUF file again"
        )
    if _FileIdentity.of(path) != identity:
        raise ValueError(
            f"{identity.path} has changed since its metadata was read into {str(folder)!r}; "
            "resolve the GGUF file again"
        )
    return path


def _write_folder(identity: _FileIdentity, out_dir: Path) -> None:
    from gguf import GGUFReader

    from common.model.gguf_llama import check_gguf_weights, write_hf_metadata

    reader = GGUFReader(identity.path)
    # Refused here, a tensor pdserve cannot read fails the start, not every worker's load.
    check_gguf_weights(reader, write_hf_metadata(reader, out_dir))
    # A file rewritten while it was read may have given metadata of neither version.
    if _FileIdentity.of(Path(identity.path)) != identity:
        raise ValueError(f"{identity.path} changed while its metadata was being read")
    (out_dir / WEIGHTS_MARKER).write_text(json.dumps(asdict(identity), indent=2) + "\n")
