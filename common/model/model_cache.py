"""pdserve's cache directory, and publishing a folder into it once across processes.

A folder is written into a hidden sibling, finished with a marker file, and renamed into place
while holding a file lock, so processes starting together write it once and none of them ever
sees a half-written folder.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

MARKER_FILE = ".pdserve-converted.json"


def cache_dir() -> Path:
    """pdserve's cache directory: `$PDSERVE_CACHE_DIR`, else `~/.cache/pdserve`."""
    # Absolute, so that a path handed to another process means the same folder there.
    configured = os.environ.get("PDSERVE_CACHE_DIR")
    if configured:
        return Path(configured).expanduser().absolute()
    return Path.home() / ".cache" / "pdserve"


def is_published(folder: Path, format_version: int) -> bool:
    """True only for a folder whose writing finished (the marker is written last) in the
    current `format_version`."""
    try:
        marker = json.loads((folder / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and marker.get("format_version") == format_version


def publish_once(
    dest: Path,
    fill: Callable[[Path], None],
    format_version: int,
    source: str,
    *,
    force: bool = False,
) -> Path:
    """`dest`, filled by `fill(staging_folder)` unless a finished folder is there already.

    Safe to call from several processes at once: one fills, the others wait on the lock and
    then reuse its folder. `force` rewrites the folder even when a finished one exists.
    `source` is recorded in the marker, for whoever reads the folder later.
    """
    if not force and is_published(dest, format_version):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(dest.parent / f".{dest.name}.lock"):
        # Another process may have finished while this one waited for the lock.
        if force or not is_published(dest, format_version):
            _fill_into_place(dest, fill, {"format_version": format_version, "source": source})
    return dest


@contextlib.contextmanager
def _exclusive_lock(lock_path: Path) -> Iterator[None]:
    # The lock file is never deleted: removing it would let a waiter lock an unlinked inode
    # while a newcomer locks a fresh file, and both would write the folder.
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def _fill_into_place(dest: Path, fill: Callable[[Path], None], marker: dict) -> None:
    """Fill a hidden sibling of `dest` and rename it into place. Caller holds the lock."""
    _remove_leftovers(dest)
    staging = dest.with_name(f".{dest.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    staging.mkdir()
    try:
        fill(staging)
        _fsync_tree(staging)
        _write_marker(staging, marker)
        _replace_dir(staging, dest)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _remove_leftovers(dest: Path) -> None:
    # Only the lock holder creates these siblings, so any found under the lock belong to a
    # process that died mid-write.
    for pattern in (f".{dest.name}.tmp-*", f".{dest.name}.old-*"):
        for leftover in dest.parent.glob(pattern):
            shutil.rmtree(leftover, ignore_errors=True)


def _fsync_tree(folder: Path) -> None:
    # Without this a power cut could leave the rename on disk but not the data behind it.
    for path in folder.iterdir():
        with path.open("rb") as f:
            os.fsync(f.fileno())
    _fsync_dir(folder)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_marker(folder: Path, marker: dict) -> None:
    with (folder / MARKER_FILE).open("w") as f:
        json.dump(marker, f)
        f.flush()
        os.fsync(f.fileno())


def _replace_dir(staging: Path, dest: Path) -> None:
    """Rename `staging` to `dest`, moving an existing (stale or forced-out) `dest` aside first."""
    old = None
    if dest.exists():
        old = dest.with_name(f".{dest.name}.old-{uuid.uuid4().hex[:8]}")
        dest.rename(old)
    staging.rename(dest)
    _fsync_dir(dest.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
