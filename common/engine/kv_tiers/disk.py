"""The disk tier: one file per page in a directory that several workers may share.

A file is ``<page hash>-<fingerprint>.kvb``, each 16 hex digits, and holds::

    header   magic "PDKV", version, flags (bit 0: has a parent), page hash, parent hash,
             fingerprint (weights and KV format, ``block.kv_fingerprint``), token count,
             data length, scales length                      (``_HEADER``, little-endian)
    tokens   the page's token ids, int64
    payload  the page's KV bytes, then its scales' bytes (quantised pools)
    checksum CRC-32 of everything above

A block is a hit only if every part checks: a file that is missing, short, long, damaged
(checksum), of another version, under other weights or another KV format (fingerprint), or
whose hash, parent or token ids are not the ones asked for, is a miss, and a damaged one is
removed. Never a wrong token, at worst a recomputed page.

Writers write a temporary file in the same directory and rename it into place: a rename is
atomic, so a reader (this process or another) sees a whole file or none, and two workers
writing the same page leave one whole copy. A file's modification time is its last use: a read
sets it, so every process sharing the directory sees the same recency.

``capacity_bytes`` bounds the directory, not one process's share of it. Each process keeps the
books of its fingerprint's files (those it found, wrote or read, with their last use) and of the
directory's other blocks (other weights' or formats', with their times as last seen), and past
the capacity removes the least recently used of them all. Between its writes, every
``sync_interval_s`` at most, a writer takes the directory's listing again (``sync``): blocks
others wrote join its books (and reach the router as stored pages), blocks others removed leave
them, and a temporary file older than ``stale_temporary_s`` (its writer crashed between writing
and renaming) is removed. A file another process removed meanwhile is simply a miss.

``put``, ``get`` and ``sync`` run on the mover thread; ``contains``, ``hashes`` and
``drain_events`` on the step thread; the books are under a lock.
"""

from __future__ import annotations

import contextlib
import logging
import os
import struct
import threading
import time
import zlib
from collections import OrderedDict
from pathlib import Path

from common.engine.kv_tiers.block import PageKey

logger = logging.getLogger(__name__)

MAGIC = b"PDKV"
VERSION = 1
_HEADER = struct.Struct("<4sHHQQQIQQ")
_CHECKSUM = struct.Struct("<I")
_HAS_PARENT = 1
SUFFIX = ".kvb"
TEMPORARY_SUFFIX = ".tmp"
# How often a writer takes the directory's listing again (its other writers' blocks), at most.
SYNC_INTERVAL_S = 10.0
# A temporary file this old is a crashed writer's: a block is written and renamed in well under
# a second, so ten minutes leaves a live but stalled writer (a hung disk) alone.
STALE_TEMPORARY_S = 600.0


class DiskTier:
    def __init__(
        self,
        directory: str | Path,
        capacity_bytes: int,
        fingerprint: int,
        sync_interval_s: float = SYNC_INTERVAL_S,
        stale_temporary_s: float = STALE_TEMPORARY_S,
    ) -> None:
        if capacity_bytes < 1:
            raise ValueError(f"--kv-offloading-disk-size must be positive, got {capacity_bytes}")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.capacity_bytes = capacity_bytes
        self.fingerprint = fingerprint
        self.sync_interval_s = sync_interval_s
        self.stale_temporary_s = stale_temporary_s
        self._suffix = f"-{fingerprint:016x}{SUFFIX}"
        self._lock = threading.Lock()
        # This fingerprint's files: page hash -> (size, last use as wall-clock time), LRU first.
        self._files: OrderedDict[int, tuple[int, float]] = OrderedDict()
        self._bytes = 0
        # The directory's other blocks (file name -> (size, modification time)), oldest first:
        # they count against the capacity and may be removed for it, but are never read here.
        self._others: OrderedDict[str, tuple[int, float]] = OrderedDict()
        self._others_bytes = 0
        self._synced_at = time.monotonic()
        self._stored: list[int] = []
        self._removed: list[int] = []
        self.num_evicted = 0
        self.rejected: dict[str, int] = {}  # why blocks read were misses, by reason
        # Hashes whose file is not a block this tier may read but is not its to remove (another
        # page's, or another version's): no longer looked for, or a prompt would try it again.
        self._unreadable: set[int] = set()
        self._scan()

    # -- step thread ----------------------------------------------------------------------------

    def path(self, page_hash: int) -> Path:
        return self.directory / f"{page_hash:016x}{self._suffix}"

    def contains(self, page_hash: int) -> bool:
        """Whether a file for the page is there now (written by any process); whether it is
        whole is known only when it is read."""
        with self._lock:
            if page_hash in self._files:
                return True
            if page_hash in self._unreadable:
                return False
        return self.path(page_hash).exists()

    def hashes(self) -> list[int]:
        with self._lock:
            return list(self._files)

    def drain_events(self) -> tuple[list[int], list[int]]:
        with self._lock:
            stored, self._stored = self._stored, []
            removed, self._removed = self._removed, []
        return stored, removed

    # -- mover thread ---------------------------------------------------------------------------

    def put(self, key: PageKey, data: bytes | memoryview, scales: bytes | memoryview) -> int:
        """Write one page's block; returns the bytes written (0 if it was there already)."""
        if time.monotonic() - self._synced_at >= self.sync_interval_s:
            self.sync()
        with self._lock:
            if key.page_hash in self._files:
                self._use(key.page_hash)
                return 0
            self._unreadable.discard(key.page_hash)
        blob = encode_block(key, self.fingerprint, data, scales)
        final = self.path(key.page_hash)
        temporary = final.with_name(
            f".{final.name}.{os.getpid()}.{threading.get_ident()}{TEMPORARY_SUFFIX}"
        )
        try:
            with open(temporary, "wb") as file:
                file.write(blob)
            os.replace(temporary, final)
        except OSError as error:  # a full disk; or a sync took it for a crashed writer's
            logger.warning("disk KV tier: page %016x not written: %s", key.page_hash, error)
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            return 0
        with self._lock:
            self._add(key.page_hash, len(blob), time.time())
            self._stored.append(key.page_hash)
            self._evict_over_capacity()
        return len(blob)

    def get(self, key: PageKey) -> tuple[memoryview, memoryview] | None:
        """The page's KV bytes and scales' bytes, or None where the block is a miss (see the
        module's docstring)."""
        path = self.path(key.page_hash)
        try:
            with open(path, "rb") as file:
                # Read into a buffer of our own: the pages copied out of it need no second copy.
                blob = bytearray(os.fstat(file.fileno()).st_size)
                del blob[file.readinto(blob) :]
        except FileNotFoundError:
            self._reject("missing")
            self._forget(key.page_hash)
            return None
        decoded = decode_block(blob, self.fingerprint)
        if isinstance(decoded, str):
            self._reject(decoded)
            if decoded in ("damaged", "truncated"):
                self._remove_file(key.page_hash)
            else:
                self._set_aside(key.page_hash)
            return None
        found, data, scales = decoded
        if found != key:
            self._reject("other page")
            self._set_aside(key.page_hash)
            return None
        with contextlib.suppress(OSError):
            os.utime(path)  # its last use, as every process sharing the directory sees it
        with self._lock:
            if key.page_hash in self._files:
                self._use(key.page_hash)
            else:  # written by another process sharing the directory
                self._add(key.page_hash, len(blob), time.time())
                self._stored.append(key.page_hash)
                self._evict_over_capacity()
        return data, scales

    def sync(self) -> None:
        """Take the directory's listing again: file the blocks other processes wrote under this
        fingerprint (their headers are checked when read), forget those they removed, note the
        other blocks' sizes, remove crashed writers' temporary files, and keep the whole
        directory within the capacity, least recently used first."""
        self._synced_at = time.monotonic()
        listed = self._list_directory()
        with self._lock:
            mine = {
                page_hash: entry
                for page_hash, entry in listed.items()
                if isinstance(page_hash, int)
            }
            for page_hash in list(self._files):
                if page_hash not in mine:
                    self._forget_locked(page_hash)
            found = sorted(
                (entry[1], page_hash)
                for page_hash, entry in mine.items()
                if page_hash not in self._files and page_hash not in self._unreadable
            )
            for used_at, page_hash in found:
                self._add(page_hash, mine[page_hash][0], used_at)
                self._stored.append(page_hash)
            # Every use sets a file's modification time, whichever process made it: the listing
            # is the directory's one order of last use.
            self._files = OrderedDict(
                (page_hash, (size, mine[page_hash][1]))
                for page_hash, (size, _) in sorted(
                    self._files.items(), key=lambda item: mine[item[0]][1]
                )
            )
            self._note_others(listed)
            self._evict_over_capacity()

    def _list_directory(self) -> dict[int | str, tuple[int, float]]:
        """Every block in the directory: this fingerprint's by page hash, others' by file name,
        each as (size, modification time); removes stale temporary files on the way."""
        listed: dict[int | str, tuple[int, float]] = {}
        now = time.time()
        for entry in os.scandir(self.directory):
            name = entry.name
            try:
                stat = entry.stat()
            except OSError:
                continue  # removed meanwhile
            if name.startswith(".") and name.endswith(TEMPORARY_SUFFIX):
                if now - stat.st_mtime > self.stale_temporary_s:
                    with contextlib.suppress(OSError):
                        os.unlink(entry.path)
                    logger.info("disk KV tier: removed a crashed writer's %s", name)
                continue
            if not name.endswith(SUFFIX) or name.startswith("."):
                continue
            if name.endswith(self._suffix):
                try:
                    listed[int(name[:16], 16)] = (stat.st_size, stat.st_mtime)
                except ValueError:
                    continue
            else:
                listed[name] = (stat.st_size, stat.st_mtime)
        return listed

    # -- books ----------------------------------------------------------------------------------

    def _scan(self) -> None:
        """Take the books of the blocks of this fingerprint already in the directory (a
        restarted worker's, or another's), oldest first, and of the others; a file whose header
        does not check is left out (and read as a miss if ever asked for)."""
        listed = self._list_directory()
        found: list[tuple[float, int, int]] = []
        for page_hash, (size, mtime) in listed.items():
            if not isinstance(page_hash, int):
                continue
            try:
                with open(self.path(page_hash), "rb") as file:
                    header = file.read(_HEADER.size)
            except OSError:
                continue
            if header_problem(header, self.fingerprint, size) is None:
                found.append((mtime, page_hash, size))
        with self._lock:
            for used_at, page_hash, size in sorted(found):
                self._add(page_hash, size, used_at)
                self._stored.append(page_hash)
            self._note_others(listed)
            self._evict_over_capacity()
        if found:
            logger.info("disk KV tier %s: %d blocks found", self.directory, len(found))

    def _note_others(self, listed: dict[int | str, tuple[int, float]]) -> None:
        """Book the listing's blocks of other weights or formats, oldest first (under the
        lock)."""
        others = sorted(
            (mtime, name, size) for name, (size, mtime) in listed.items() if isinstance(name, str)
        )
        self._others = OrderedDict((name, (size, mtime)) for mtime, name, size in others)
        self._others_bytes = sum(size for _, _, size in others)

    def _add(self, page_hash: int, size: int, used_at: float) -> None:
        self._files[page_hash] = (size, used_at)
        self._bytes += size

    def _use(self, page_hash: int) -> None:
        self._files[page_hash] = (self._files[page_hash][0], time.time())
        self._files.move_to_end(page_hash)

    def _evict_over_capacity(self) -> None:
        """Remove the least recently used blocks, this fingerprint's or others', until the
        directory is within the capacity (under the lock)."""
        while self._bytes + self._others_bytes > self.capacity_bytes and (
            self._files or self._others
        ):
            mine = next(iter(self._files.items()), None)
            other = next(iter(self._others.items()), None)
            if mine is None or (other is not None and other[1][1] < mine[1][1]):
                assert other is not None
                name, (size, _) = other
                del self._others[name]
                self._others_bytes -= size
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.directory / name)
                continue
            page_hash, (size, _) = mine
            del self._files[page_hash]
            self._bytes -= size
            self._removed.append(page_hash)
            self.num_evicted += 1
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path(page_hash))

    def _reject(self, reason: str) -> None:
        with self._lock:
            self.rejected[reason] = self.rejected.get(reason, 0) + 1

    def _forget(self, page_hash: int) -> None:
        with self._lock:
            self._forget_locked(page_hash)

    def _forget_locked(self, page_hash: int) -> None:
        entry = self._files.pop(page_hash, None)
        if entry is not None:
            self._bytes -= entry[0]
            self._removed.append(page_hash)

    def _set_aside(self, page_hash: int) -> None:
        self._forget(page_hash)
        with self._lock:
            self._unreadable.add(page_hash)

    def _remove_file(self, page_hash: int) -> None:
        self._forget(page_hash)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path(page_hash))


def encode_block(
    key: PageKey, fingerprint: int, data: bytes | memoryview, scales: bytes | memoryview
) -> bytes:
    header = _HEADER.pack(
        MAGIC,
        VERSION,
        _HAS_PARENT if key.parent is not None else 0,
        key.page_hash,
        key.parent or 0,
        fingerprint,
        len(key.token_ids),
        len(data),
        len(scales),
    )
    tokens = struct.pack(f"<{len(key.token_ids)}q", *key.token_ids)
    checksum = zlib.crc32(scales, zlib.crc32(data, zlib.crc32(tokens, zlib.crc32(header))))
    return b"".join((header, tokens, data, scales, _CHECKSUM.pack(checksum)))


def header_problem(header: bytes | bytearray, fingerprint: int, size: int) -> str | None:
    """Why a block's header (and its file's size) is not one this tier can read, or None."""
    if len(header) < _HEADER.size:
        return "truncated"
    magic, version, _, _, _, found_print, num_tokens, data_len, scales_len = _HEADER.unpack(
        header[: _HEADER.size]
    )
    if magic != MAGIC:
        return "damaged"
    if version != VERSION:
        return "other version"
    if found_print != fingerprint:
        return "other weights or format"
    expected = _HEADER.size + 8 * num_tokens + data_len + scales_len + _CHECKSUM.size
    if size < expected:
        return "truncated"
    if size > expected:
        return "damaged"
    return None


def decode_block(
    blob: bytes | bytearray, fingerprint: int
) -> tuple[PageKey, memoryview, memoryview] | str:
    """The page a block holds and its bytes, or why it cannot be read."""
    problem = header_problem(blob, fingerprint, len(blob))
    if problem is not None:
        return problem
    body = len(blob) - _CHECKSUM.size
    (checksum,) = _CHECKSUM.unpack_from(blob, body)
    if zlib.crc32(memoryview(blob)[:body]) != checksum:
        return "damaged"
    _, _, flags, page_hash, parent, _, num_tokens, data_len, scales_len = _HEADER.unpack_from(blob)
    start = _HEADER.size
    tokens = struct.unpack_from(f"<{num_tokens}q", blob, start)
    start += 8 * num_tokens
    view = memoryview(blob)
    data = view[start : start + data_len]
    scales = view[start + data_len : start + data_len + scales_len]
    key = PageKey(page_hash, parent if flags & _HAS_PARENT else None, tuple(tokens))
    return key, data, scales
