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
writing the same page leave one whole copy. Each process keeps the size books of the files it
knows (those it found at start and those it wrote or read) and removes its least recently used
when they pass ``capacity_bytes``; a file another process removed meanwhile is simply a miss.

``put`` and ``get`` run on the mover thread; ``contains``, ``hashes`` and ``drain_events`` on
the step thread; the books are under a lock.
"""

from __future__ import annotations

import contextlib
import logging
import os
import struct
import threading
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


class DiskTier:
    def __init__(self, directory: str | Path, capacity_bytes: int, fingerprint: int) -> None:
        if capacity_bytes < 1:
            raise ValueError(f"--kv-offloading-disk-size must be positive, got {capacity_bytes}")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.capacity_bytes = capacity_bytes
        self.fingerprint = fingerprint
        self._suffix = f"-{fingerprint:016x}{SUFFIX}"
        self._lock = threading.Lock()
        self._files: OrderedDict[int, int] = OrderedDict()  # page hash -> file size, LRU first
        self._bytes = 0
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
        with self._lock:
            if key.page_hash in self._files:
                self._files.move_to_end(key.page_hash)
                return 0
        with self._lock:
            self._unreadable.discard(key.page_hash)
        blob = encode_block(key, self.fingerprint, data, scales)
        final = self.path(key.page_hash)
        temporary = final.with_name(f".{final.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        with open(temporary, "wb") as file:
            file.write(blob)
        os.replace(temporary, final)
        with self._lock:
            self._add(key.page_hash, len(blob))
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
        with self._lock:
            if key.page_hash in self._files:
                self._files.move_to_end(key.page_hash)
            else:  # written by another process sharing the directory
                self._add(key.page_hash, len(blob))
                self._stored.append(key.page_hash)
                self._evict_over_capacity()
        return data, scales

    # -- books ----------------------------------------------------------------------------------

    def _scan(self) -> None:
        """Take the books of the blocks of this fingerprint already in the directory (a
        restarted worker's, or another's), oldest first; a file whose header does not check is
        left out (and read as a miss if ever asked for)."""
        found: list[tuple[float, int, int]] = []
        for entry in os.scandir(self.directory):
            if not entry.name.endswith(self._suffix) or entry.name.startswith("."):
                continue
            try:
                page_hash = int(entry.name[:16], 16)
                stat = entry.stat()
                with open(entry.path, "rb") as file:
                    header = file.read(_HEADER.size)
            except (ValueError, OSError):
                continue
            if header_problem(header, self.fingerprint, stat.st_size) is None:
                found.append((stat.st_mtime, page_hash, stat.st_size))
        with self._lock:
            for _, page_hash, size in sorted(found):
                self._add(page_hash, size)
                self._stored.append(page_hash)
            self._evict_over_capacity()
        if found:
            logger.info("disk KV tier %s: %d blocks found", self.directory, len(found))

    def _add(self, page_hash: int, size: int) -> None:
        self._files[page_hash] = size
        self._bytes += size

    def _evict_over_capacity(self) -> None:
        while self._bytes > self.capacity_bytes and self._files:
            page_hash, size = self._files.popitem(last=False)
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
            size = self._files.pop(page_hash, None)
            if size is not None:
                self._bytes -= size
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
