"""The disk tier of the KV cache (worker/kv_tier.py): what it stores it returns byte for byte; an
entry that is corrupt, truncated or another model's is a miss, never a wrong block; a full
budget drops the least recently used; a directory that cannot hold it is a clear error."""
from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap

import pytest
import torch

from pagellm.worker.kv_tier import DiskKVTier

FP = bytes(range(16))
BLOCK = 5000  # not a multiple of the page size


def _payload(i: int) -> torch.Tensor:
    return torch.randint(0, 256, (BLOCK,), dtype=torch.uint8, generator=torch.Generator().manual_seed(i))


def _key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def _tier(path, slots=4, **kw) -> DiskKVTier:
    return DiskKVTier(str(path), DiskKVTier.slot_size(BLOCK) * slots, BLOCK, kw.pop("fingerprint", FP), **kw)


def test_blocks_come_back_byte_for_byte_and_the_oldest_go_first(tmp_path):
    tier = _tier(tmp_path, slots=4)
    for i in range(4):
        tier.store(_key(i), _payload(i))
    tier.flush()
    assert torch.equal(tier.load(_key(0)), _payload(0))  # 0 is now the most recently used
    for i in (4, 5):
        tier.store(_key(i), _payload(i))
    tier.flush()
    assert tier.load(_key(1)) is None and tier.load(_key(2)) is None  # the two least recently used
    for i in (0, 3, 4, 5):
        assert torch.equal(tier.load(_key(i)), _payload(i))
    s = tier.stats()
    assert s.blocks == 4 and s.capacity_blocks == 4 and s.corrupt == 0 and s.bytes_written == 6 * BLOCK
    path = tier.path
    tier.close()
    assert not path.exists()  # not persisted: removed at shutdown


def test_a_block_is_served_before_its_write_lands(tmp_path):
    tier = _tier(tmp_path)
    tier.store(_key(1), _payload(1))  # no flush
    assert torch.equal(tier.load(_key(1)), _payload(1))
    tier.close()


def test_corrupt_and_truncated_entries_are_misses(tmp_path):
    tier = _tier(tmp_path, slots=4)
    for i in range(3):
        tier.store(_key(i), _payload(i))
    tier.flush()
    with open(tier.path, "r+b") as f:  # flip one byte of the first slot's payload
        f.seek(4096 + 17)
        b = f.read(1)
        f.seek(4096 + 17)
        f.write(bytes([b[0] ^ 0xFF]))
    got = [tier.load(_key(i)) for i in range(3)]
    assert sum(g is None for g in got) == 1 and tier.stats().corrupt == 1
    assert all(torch.equal(g, _payload(i)) for i, g in enumerate(got) if g is not None)
    os.truncate(tier.path, tier.slot_bytes + 10)  # the file cut short while the tier runs
    assert [tier.load(_key(i)) for i in range(3)].count(None) == 3
    tier.store(_key(7), _payload(7))  # and it keeps working: writes extend the file again
    tier.flush()
    assert torch.equal(tier.load(_key(7)), _payload(7))
    tier.close()


def test_persisted_blocks_survive_a_restart_and_other_models_do_not_see_them(tmp_path):
    tier = _tier(tmp_path, persist=True)
    tier.store(_key(1), _payload(1))
    tier.close()
    again = _tier(tmp_path, persist=True)
    assert torch.equal(again.load(_key(1)), _payload(1))
    again.close()
    # Another fingerprint (another model, KV format or block size) gets its own file ...
    other = _tier(tmp_path, persist=True, fingerprint=bytes(16))
    assert other.load(_key(1)) is None
    other.close()
    # ... and a foreign file put in its place is read as nothing.
    os.replace(tier.path, other.path)
    other = _tier(tmp_path, persist=True, fingerprint=bytes(16))
    assert other.load(_key(1)) is None and other.stats().blocks == 0
    other.close()


def test_unusable_directories_and_budgets_are_clear_errors(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(stat.S_IRUSR | stat.S_IXUSR)
    if os.access(locked, os.W_OK):  # running as root: permissions do not bind
        target = tmp_path / "file"
        target.write_text("x")
        with pytest.raises(ValueError, match="kv_offload_dir=.* cannot be created"):
            DiskKVTier(str(target / "sub"), 1 << 20, BLOCK, FP)
    else:
        with pytest.raises(ValueError, match="kv_offload_dir=.* is not writable"):
            DiskKVTier(str(locked), 1 << 20, BLOCK, FP)
    with pytest.raises(ValueError, match="kv_offload_size=100 holds no KV block"):
        DiskKVTier(str(tmp_path), 100, BLOCK, FP)


def test_a_budget_the_disk_cannot_hold_fails_at_start(tmp_path):
    """A file-size limit stands in for a full disk: preallocating the file fails up front, with
    the option named, and leaves no file behind."""
    code = textwrap.dedent(f"""
        import resource, signal
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
        from pagellm.worker.kv_tier import DiskKVTier
        try:
            DiskKVTier({str(tmp_path)!r}, 64 << 20, {BLOCK}, bytes(range(16)))
        except ValueError as e:
            print("ERROR", e)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "ERROR kv_offload_size=" in out.stdout and "does not fit" in out.stdout, out.stdout + out.stderr
    assert not list(tmp_path.glob("pagellm-kv-*"))


def _swap_file(tier: DiskKVTier, path: str, flags: int) -> None:
    """Put another file under the tier's descriptor, as a volume that fills up or turns read-only
    does: the tier's own reads and writes meet what the kernel answers for it."""
    fd = os.open(path, flags)
    os.dup2(fd, tier._fd)
    os.close(fd)


def test_failed_writes_are_skipped_and_counted_by_cause_and_logged_once_each(tmp_path, caplog):
    tier = _tier(tmp_path, slots=8)
    tier.store(_key(0), _payload(0))
    tier.flush()
    # A descriptor that cannot write (as a volume remounted read-only): what is stored still loads.
    _swap_file(tier, str(tier.path), os.O_RDONLY)
    for i in (1, 2):
        tier.store(_key(i), _payload(i))
    tier.flush()
    assert torch.equal(tier.load(_key(0)), _payload(0))
    assert tier.load(_key(1)) is None and tier.load(_key(2)) is None
    # /dev/full: every write fails with ENOSPC, as on a full volume (and reads give zeros: misses).
    _swap_file(tier, "/dev/full", os.O_RDWR)
    for i in (3, 4, 5):
        tier.store(_key(i), _payload(i))
    tier.flush()
    s = tier.stats()
    assert s.write_errors_by_cause == {"EBADF": 2, "ENOSPC": 3} and s.write_errors == 5
    assert s.blocks == 1 and s.pending_writes == 0 and s.bytes_written == BLOCK
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and "write failed" in r.getMessage()]
    assert len(warnings) == 2 and "EBADF" in warnings[0] and "ENOSPC" in warnings[1]
    assert tier.load(_key(0)) is None  # zeros read back: refused by its checks, not served
    tier.close()


def test_a_persisted_file_cut_short_keeps_its_whole_slots(tmp_path):
    tier = _tier(tmp_path, slots=4, persist=True)
    for i in range(4):  # one slot each, in order
        tier.store(_key(i), _payload(i))
    tier.close()
    os.truncate(tier.path, 2 * tier.slot_bytes + 4096 + 100)  # slot 2 loses most of its bytes, slot 3 all
    again = _tier(tmp_path, slots=4, persist=True)
    assert again.path.stat().st_size == 4 * again.slot_bytes  # extended again to the budget
    assert torch.equal(again.load(_key(0)), _payload(0)) and torch.equal(again.load(_key(1)), _payload(1))
    assert again.load(_key(2)) is None and again.load(_key(3)) is None
    assert again.stats().corrupt == 1  # slot 2's header survived, its bytes did not
    for i in (4, 5):  # the two slots lost take new blocks
        again.store(_key(i), _payload(i))
    again.flush()
    assert again.stats().blocks == 4
    again.close()
    # A smaller budget keeps the slots within it.
    small = _tier(tmp_path, slots=2, persist=True)
    assert small.path.stat().st_size == 2 * small.slot_bytes
    kept = [i for i in range(6) if small.load(_key(i)) is not None]
    assert kept == [0, 1]
    small.close()
