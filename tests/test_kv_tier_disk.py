"""The disk tier's blocks: what is read back is what was written, and a block that is missing,
truncated, damaged, of other weights or format, or of another page is a miss (never other
bytes); two processes writing one directory at once leave only whole blocks; a restarted tier
finds its blocks and leaves out those whose header does not check; workers sharing a directory
keep it within its size together, and a crashed writer's temporary files are cleaned up."""

from __future__ import annotations

import multiprocessing
import os
import time
from pathlib import Path

import pytest

from common.engine.kv_tiers import disk as disk_module
from common.engine.kv_tiers.block import PageKey, kv_fingerprint
from common.engine.kv_tiers.disk import DiskTier
from common.kv_layout import KVLayout

FINGERPRINT = kv_fingerprint("model-a|bfloat16", KVLayout("bfloat16", 16, 2, 2, 16))
OTHER_FINGERPRINT = kv_fingerprint("model-b|bfloat16", KVLayout("bfloat16", 16, 2, 2, 16))
PAGE_BYTES = 4096


def key(n: int, parent: int | None = None) -> PageKey:
    return PageKey(0x1000 + n, parent, tuple(range(n, n + 16)))


def page(n: int) -> bytes:
    return bytes((n + i) % 251 for i in range(PAGE_BYTES))


def test_a_block_reads_back_as_written(tmp_path):
    tier = DiskTier(tmp_path, 1 << 20, FINGERPRINT)
    assert tier.put(key(1), page(1), b"scales") > PAGE_BYTES
    assert tier.put(key(1), page(1), b"scales") == 0  # there already
    assert tier.contains(key(1).page_hash)
    data, scales = tier.get(key(1))
    assert (bytes(data), bytes(scales)) == (page(1), b"scales")
    assert tier.get(key(2)) is None  # never written: missing
    assert tier.rejected == {"missing": 1}


def corrupt(path: Path, how: str) -> None:
    blob = bytearray(path.read_bytes())
    if how == "truncated":
        del blob[-100:]
    elif how == "flipped payload byte":
        blob[len(blob) // 2] ^= 0x01
    elif how == "flipped checksum byte":
        blob[-1] ^= 0x80
    elif how == "bad magic":
        blob[0:4] = b"XXXX"
    elif how == "appended":
        blob += b"\0"
    path.write_bytes(bytes(blob))


@pytest.mark.parametrize(
    "how, reason",
    [
        ("truncated", "truncated"),
        ("flipped payload byte", "damaged"),
        ("flipped checksum byte", "damaged"),
        ("bad magic", "damaged"),
        ("appended", "damaged"),
    ],
)
def test_a_damaged_or_truncated_block_is_a_miss_and_is_removed(tmp_path, how, reason):
    tier = DiskTier(tmp_path, 1 << 20, FINGERPRINT)
    tier.put(key(1), page(1), b"")
    corrupt(tier.path(key(1).page_hash), how)
    assert tier.get(key(1)) is None
    assert tier.rejected == {reason: 1}
    assert not tier.path(key(1).page_hash).exists()
    assert not tier.contains(key(1).page_hash)


def test_a_block_of_other_weights_or_format_is_a_miss(tmp_path):
    other_weights = kv_fingerprint("model-b|bfloat16", KVLayout("bfloat16", 16, 2, 2, 16))
    other_format = kv_fingerprint("model-a|bfloat16", KVLayout("int8_hadamard", 16, 2, 2, 16))
    assert len({FINGERPRINT, other_weights, other_format}) == 3
    ours = DiskTier(tmp_path, 1 << 20, FINGERPRINT)
    for fingerprint in (other_weights, other_format):
        theirs = DiskTier(tmp_path, 1 << 20, fingerprint)
        theirs.put(key(1), page(1), b"")
        assert not ours.contains(key(1).page_hash)  # filed under their fingerprint
        # Even put where ours would look, its header says whose it is.
        os.replace(theirs.path(key(1).page_hash), ours.path(key(1).page_hash))
        assert ours.get(key(1)) is None
        assert ours.rejected == {"other weights or format": 1}
        assert ours.path(key(1).page_hash).exists()  # not ours to remove,
        assert not ours.contains(key(1).page_hash)  # but not looked for again
        ours.path(key(1).page_hash).unlink()
        ours.put(key(1), page(1), b"")  # a block of our own takes its place
        assert bytes(ours.get(key(1))[0]) == page(1)
        ours.path(key(1).page_hash).unlink()
        ours = DiskTier(tmp_path, 1 << 20, FINGERPRINT)


def test_a_block_of_another_page_under_the_hash_is_a_miss(tmp_path):
    """The hash asked for, but other token ids or another parent: a collision, or a stale
    block, never served."""
    tier = DiskTier(tmp_path, 1 << 20, FINGERPRINT)
    tier.put(key(1, parent=7), page(1), b"")
    other_tokens = PageKey(key(1).page_hash, 7, tuple(range(100, 116)))
    assert tier.get(other_tokens) is None
    assert not tier.contains(key(1).page_hash)  # set aside: a prompt does not try it again
    assert tier.get(key(1, parent=8)) is None
    assert tier.get(key(1, parent=7)) is not None  # the page it is, asked for by name
    assert tier.rejected == {"other page": 2}


def test_the_tier_keeps_to_its_size_least_recently_used_first(tmp_path):
    # Room for three blocks (a page, its 16 token ids, a header and a checksum), not four.
    tier = DiskTier(tmp_path, 3 * (PAGE_BYTES + 400), FINGERPRINT)
    for n in range(3):
        tier.put(key(n), page(n), b"")
    assert tier.get(key(0)) is not None  # used again: the oldest is now 1
    tier.put(key(3), page(3), b"")
    assert not tier.contains(key(1).page_hash)
    assert all(tier.contains(key(n).page_hash) for n in (0, 2, 3))
    assert tier.num_evicted == 1
    _, removed = tier.drain_events()
    assert removed == [key(1).page_hash]


def write_blocks(directory: str, first: int, count: int) -> None:
    tier = DiskTier(directory, 1 << 30, FINGERPRINT)
    for n in range(first, first + count):
        tier.put(key(n), page(n), b"")


def test_two_processes_writing_one_directory_leave_whole_blocks(tmp_path):
    """Two writers, half of their pages the same, at once: every block reads back whole by a
    third tier, and no temporary file is left."""
    context = multiprocessing.get_context("fork")
    writers = [
        context.Process(target=write_blocks, args=(str(tmp_path), first, 60)) for first in (0, 30)
    ]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join(timeout=120)
        assert writer.exitcode == 0
    reader = DiskTier(tmp_path, 1 << 30, FINGERPRINT)
    assert len(reader.hashes()) == 90  # found at start
    for n in range(90):
        data, _ = reader.get(key(n))
        assert bytes(data) == page(n)
    assert reader.rejected == {}
    assert not [name for name in os.listdir(tmp_path) if name.endswith(".tmp")]


def test_a_restarted_tier_finds_its_blocks_and_leaves_out_bad_ones(tmp_path):
    first = DiskTier(tmp_path, 1 << 20, FINGERPRINT)
    for n in range(4):
        first.put(key(n), page(n), b"")
    corrupt(first.path(key(3).page_hash), "truncated")
    (tmp_path / "unrelated.txt").write_text("not a block")
    again = DiskTier(tmp_path, 1 << 20, FINGERPRINT)
    assert sorted(again.hashes()) == [key(n).page_hash for n in range(3)]
    assert again.drain_events() == ([key(n).page_hash for n in range(3)], [])
    assert bytes(again.get(key(2))[0]) == page(2)


def age(tier: DiskTier, n: int, seconds_ago: float) -> None:
    """Set block ``n``'s last use (its file's modification time) ``seconds_ago``."""
    when = time.time() - seconds_ago
    os.utime(tier.path(key(n).page_hash), (when, when))


BLOCK_BYTES = PAGE_BYTES + 400  # a page, its 16 token ids, a header and a checksum, rounded up


def test_workers_sharing_a_directory_keep_it_within_the_size_together(tmp_path):
    """Room for four blocks: a second writer counts the first's blocks against the size and
    removes the least recently used of them all; the first learns of both from the listing."""
    first = DiskTier(tmp_path, 4 * BLOCK_BYTES, FINGERPRINT, sync_interval_s=0)
    second = DiskTier(tmp_path, 4 * BLOCK_BYTES, FINGERPRINT, sync_interval_s=0)
    for n in range(3):
        first.put(key(n), page(n), b"")
        age(first, n, 100 - n)  # 0 the least recently used
    first.drain_events()
    second.put(key(3), page(3), b"")
    assert second.drain_events() == ([key(n).page_hash for n in range(4)], [])
    second.put(key(4), page(4), b"")
    blocks = sorted(name for name in os.listdir(tmp_path) if name.endswith(".kvb"))
    assert blocks == sorted(second.path(key(n).page_hash).name for n in range(1, 5))
    assert second.drain_events() == ([key(4).page_hash], [key(0).page_hash])
    first.sync()
    assert first.drain_events() == (
        [key(3).page_hash, key(4).page_hash],
        [key(0).page_hash],
    )
    assert sorted(first.hashes()) == [key(n).page_hash for n in range(1, 5)]


def test_a_read_is_a_use_every_sharing_process_sees(tmp_path):
    writer = DiskTier(tmp_path, 2 * BLOCK_BYTES, FINGERPRINT, sync_interval_s=0)
    for n in range(2):
        writer.put(key(n), page(n), b"")
        age(writer, n, 100 - n)
    reader = DiskTier(tmp_path, 2 * BLOCK_BYTES, FINGERPRINT)
    assert reader.get(key(0)) is not None  # 0 is now the most recently used
    writer.put(key(2), page(2), b"")  # syncs first: the directory says 1 is the oldest
    assert writer.contains(key(0).page_hash)
    assert not writer.path(key(1).page_hash).exists()


def test_other_weights_blocks_count_against_the_size(tmp_path):
    other = DiskTier(tmp_path, 1 << 20, OTHER_FINGERPRINT)
    other.put(key(9), page(9), b"")
    os.utime(other.path(key(9).page_hash), (time.time() - 100,) * 2)
    tier = DiskTier(tmp_path, 2 * BLOCK_BYTES, FINGERPRINT)
    for n in range(2):
        tier.put(key(n), page(n), b"")
    assert not other.path(key(9).page_hash).exists()  # the oldest block in the directory
    assert all(tier.contains(key(n).page_hash) for n in range(2))
    assert tier.num_evicted == 0  # none of its own


def test_a_crashed_writers_temporary_files_are_removed_once_stale(tmp_path):
    stale = tmp_path / f".{'0' * 16}-{FINGERPRINT:016x}.kvb.999.1.tmp"
    fresh = tmp_path / f".{'1' * 16}-{FINGERPRINT:016x}.kvb.999.2.tmp"
    for path in (stale, fresh):
        path.write_bytes(b"half a block")
    os.utime(stale, (time.time() - 3600,) * 2)
    tier = DiskTier(tmp_path, 1 << 20, FINGERPRINT, stale_temporary_s=600)
    assert not stale.exists()
    assert fresh.exists()  # perhaps a live writer's
    os.utime(fresh, (time.time() - 3600,) * 2)
    tier.sync()
    assert not fresh.exists()
    assert tier.hashes() == []


def test_a_write_that_fails_is_no_block_and_no_error(tmp_path, monkeypatch):
    tier = DiskTier(tmp_path, 1 << 20, FINGERPRINT)

    def lost(source, target):
        raise FileNotFoundError(source)  # as if a sync had taken it for a crashed writer's

    monkeypatch.setattr(disk_module.os, "replace", lost)
    assert tier.put(key(1), page(1), b"") == 0
    assert not tier.contains(key(1).page_hash)
    assert os.listdir(tmp_path) == []
