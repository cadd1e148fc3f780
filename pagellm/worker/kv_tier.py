"""The KV cache's second tier on local disk (`--kv-offload-dir`): whole blocks by their prefix hash.

One file of fixed-size slots, each a header and one block's bytes (every KV layer's K and V of
one block id, as the model runner lays them out), preallocated up front so that a full disk is an
error at start-up rather than a failed write later. A slot's header holds the block's key, the
model's fingerprint and a checksum of the bytes; a load reads header and bytes together and
returns them only if all three match, so an entry that is corrupt, truncated, half-written or
written by another model (or another KV format, block size or pagellm layout) is a miss. The
slots are reached with positional reads and writes, not a memory map: a file truncated under a
mapping would kill the process with SIGBUS on the next access, where a short read is one more miss.

Demoted blocks are copied to host memory by the runner (the step is about to overwrite them) and
written by a background thread, so the engine loop does not wait on the disk; until its write
lands, a block is served from that copy. Loads are synchronous (the scheduler needs the answer).
The tier keeps its own LRU over its slots within `--kv-offload-size` bytes. Without
`--kv-offload-persist` the file is removed at shutdown; with it, a restarted server reads the
slot headers back and keeps its warm prefixes (each entry is still checked when it is loaded).
A persisted file cut short (a crash, a copy interrupted) keeps its whole slots and is extended
again; one longer than the budget loses the slots past it.

The tier is a cache: a write that fails (the volume full, remounted read-only, an I/O error)
skips that block, counted by its errno name (`write_errors_by_cause`) and logged once per cause,
and the engine serves on, recomputing what the tier could not keep.
"""
from __future__ import annotations

import errno
import hashlib
import logging
import os
import queue
import struct
import threading
import time
from collections import Counter, OrderedDict
from pathlib import Path

import torch

from pagellm.core.stats import TierStoreStats

logger = logging.getLogger(__name__)

_MAGIC = b"PGLMKV01"
# magic, key (the block's chained hash), model fingerprint, checksum of the payload, payload length.
_HEADER = struct.Struct("<8s16s16s16sQ")
_HEADER_BYTES = 4096  # the header's slot prefix: payloads stay page-aligned
_MAX_PENDING = 256  # demoted blocks waiting for the writer; beyond this a demotion is dropped


def _checksum(payload: memoryview | bytes, key: bytes, fingerprint: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=16, key=fingerprint)
    h.update(key)
    h.update(payload)
    return h.digest()


class DiskKVTier:
    """Blocks of `block_bytes` bytes under 16-byte keys, in `capacity_bytes` of `directory`."""

    def __init__(self, directory: str, capacity_bytes: int, block_bytes: int, fingerprint: bytes,
                 persist: bool = False) -> None:
        if len(fingerprint) != 16:
            raise ValueError("the model fingerprint must be 16 bytes")
        self.block_bytes = block_bytes
        self.fingerprint = fingerprint
        self.persist = persist
        self.slot_bytes = self.slot_size(block_bytes)
        self.num_slots = capacity_bytes // self.slot_bytes
        if self.num_slots < 1:
            raise ValueError(f"kv_offload_size={capacity_bytes} holds no KV block: one takes {self.slot_bytes} bytes "
                             f"on disk")
        path = Path(directory)
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"kv_offload_dir={directory!r} cannot be created: {e.strerror}") from None
        if not os.access(path, os.W_OK | os.X_OK):
            raise ValueError(f"kv_offload_dir={directory!r} is not writable by this process")
        # One file per model and layout: another model's file is left alone.
        self.path = path / f"pagellm-kv-{fingerprint.hex()[:16]}.bin"
        size = self.num_slots * self.slot_bytes
        found = self.path.stat().st_size if persist and self.path.is_file() else None
        try:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | (0 if found else os.O_TRUNC), 0o600)
        except OSError as e:
            raise ValueError(f"kv_offload_dir={directory!r}: cannot open {self.path.name}: {e.strerror}") from None
        try:
            if found is not None and found != size:
                logger.warning("KV tier %s: the file from the last run has %d bytes, not %d; the whole slots "
                               "within both are kept", self.path, found, size)
                if found > size:
                    os.ftruncate(self._fd, size)
            if not found or found < size:
                os.posix_fallocate(self._fd, 0, size)
        except OSError as e:
            os.close(self._fd)
            self.path.unlink(missing_ok=True)
            raise ValueError(f"kv_offload_size={size} bytes does not fit in kv_offload_dir={directory!r}: "
                             f"{e.strerror}") from None
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, int] = OrderedDict()  # key -> slot, least recently used first
        self._free = list(range(self.num_slots - 1, -1, -1))
        self._pending: dict[bytes, torch.Tensor] = {}  # demoted, not yet on disk
        self.hits = self.misses = self.corrupt = self.dropped = 0
        self.write_errors_by_cause: Counter[str] = Counter()  # errno name -> blocks not written
        # Seconds per byte moved to or from the disk, a moving average (None until measured): what
        # swapping costs, for preemption_mode "auto".
        self.seconds_per_byte: float | None = None
        self.bytes_written = self.bytes_read = 0
        if found:
            self._read_index()
        self._queue: queue.Queue = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="pagellm-kv-tier", daemon=True)
        self._writer.start()

    @staticmethod
    def slot_size(block_bytes: int) -> int:
        """Bytes of disk one block takes: its header's page and its bytes, rounded up to pages."""
        return _HEADER_BYTES + -(-block_bytes // 4096) * 4096

    # ---- what the runner asks (ModelRunner.apply_tier_ops, stage_tier_block) --------------------
    def store(self, key: bytes, payload: torch.Tensor, wait: bool = False) -> None:
        """Queue a block (a uint8 CPU tensor of block_bytes, owned by the tier from now on). With
        the writer behind by _MAX_PENDING blocks the block is dropped, or, with `wait`, waited for."""
        if wait and len(self._pending) >= _MAX_PENDING:
            self.flush()
        with self._lock:
            if key in self._index or key in self._pending:
                return
            if len(self._pending) >= _MAX_PENDING:
                self.dropped += 1
                return
            self._pending[key] = payload
        self._queue.put(key)

    def load(self, key: bytes) -> torch.Tensor | None:
        """The block stored under `key` as a uint8 tensor, or None: absent, or failing its checks."""
        with self._lock:
            pending = self._pending.get(key)
            if pending is not None:
                self.hits += 1
                return pending.clone()
            slot = self._index.get(key)
            if slot is None:
                self.misses += 1
                return None
            started = time.perf_counter()
            data = self._read_slot(slot)
            self._time_io(time.perf_counter() - started, self.slot_bytes)
            if data is None or data[0] != key:
                self._drop(key, slot)
                self.corrupt += 1
                self.misses += 1
                return None
            self._index.move_to_end(key)
            self.hits += 1
            self.bytes_read += self.block_bytes
        return torch.frombuffer(data[1], dtype=torch.uint8)

    # ---- bookkeeping -------------------------------------------------------------------------------
    @property
    def write_errors(self) -> int:
        return sum(self.write_errors_by_cause.values())

    @property
    def num_entries(self) -> int:
        with self._lock:
            return len(self._index) + len(self._pending)

    def stats(self) -> TierStoreStats:
        with self._lock:
            return TierStoreStats(path=str(self.path), blocks=len(self._index), pending_writes=len(self._pending),
                                  capacity_blocks=self.num_slots, block_bytes=self.block_bytes, hits=self.hits,
                                  misses=self.misses, corrupt=self.corrupt, dropped=self.dropped,
                                  write_errors=self.write_errors,
                                  write_errors_by_cause=dict(self.write_errors_by_cause),
                                  bytes_written=self.bytes_written, bytes_read=self.bytes_read, persist=self.persist)

    @property
    def is_open(self) -> bool:
        return self._fd >= 0

    def flush(self) -> None:
        """Wait until every queued block is written."""
        self._queue.join()

    def close(self) -> None:
        if self._fd < 0:
            return
        self._queue.put(None)
        self._writer.join()
        os.close(self._fd)
        self._fd = -1
        if not self.persist:
            self.path.unlink(missing_ok=True)

    # ---- the file ----------------------------------------------------------------------------------
    def _read_slot(self, slot: int) -> tuple[bytes, bytes] | None:
        """(key, payload) of a slot whose header and checksum hold, else None."""
        try:
            raw = os.pread(self._fd, self.slot_bytes, slot * self.slot_bytes)
        except OSError:
            return None
        if len(raw) < _HEADER_BYTES + self.block_bytes:  # the file was truncated under us
            return None
        magic, key, fingerprint, checksum, length = _HEADER.unpack_from(raw)
        payload = memoryview(raw)[_HEADER_BYTES:_HEADER_BYTES + self.block_bytes]
        if (magic != _MAGIC or fingerprint != self.fingerprint or length != self.block_bytes
                or checksum != _checksum(payload, key, self.fingerprint)):
            return None
        return key, bytearray(payload)

    def _read_index(self) -> None:
        """Slots of a persisted file whose headers are this model's (checksums are checked on load)."""
        for slot in range(self.num_slots):
            try:
                head = os.pread(self._fd, _HEADER.size, slot * self.slot_bytes)
            except OSError:
                break
            if len(head) < _HEADER.size:
                break
            magic, key, fingerprint, _, length = _HEADER.unpack(head)
            if magic == _MAGIC and fingerprint == self.fingerprint and length == self.block_bytes \
                    and key not in self._index:
                self._index[key] = slot
        taken = set(self._index.values())
        self._free = [s for s in range(self.num_slots - 1, -1, -1) if s not in taken]
        logger.info("KV tier %s: %d blocks kept from the last run", self.path, len(self._index))

    def _time_io(self, seconds: float, num_bytes: int) -> None:
        sample = seconds / num_bytes
        self.seconds_per_byte = sample if self.seconds_per_byte is None else 0.8 * self.seconds_per_byte + 0.2 * sample

    def _drop(self, key: bytes, slot: int) -> None:
        del self._index[key]
        self._free.append(slot)

    def _write_loop(self) -> None:
        while True:
            key = self._queue.get()
            try:
                if key is None:
                    return
                self._write(key)
            finally:
                self._queue.task_done()

    def _write(self, key: bytes) -> None:
        with self._lock:
            payload = self._pending.get(key)
            if payload is None:
                return
            if self._free:
                slot = self._free.pop()
            else:  # full: the least recently used entry gives up its slot
                _, slot = self._index.popitem(last=False)
        data = payload.numpy().tobytes()
        header = _HEADER.pack(_MAGIC, key, self.fingerprint, _checksum(data, key, self.fingerprint), len(data))
        try:
            # The payload first, then the header that makes it valid: a write cut short leaves a
            # slot whose checksum fails, a miss.
            started = time.perf_counter()
            if os.pwrite(self._fd, data, slot * self.slot_bytes + _HEADER_BYTES) < len(data):
                raise OSError(errno.ENOSPC, "a short write")  # what a nearly full volume does
            os.pwrite(self._fd, header, slot * self.slot_bytes)
            error = None
        except OSError as e:
            error = e
        first_of_its_cause = False
        with self._lock:
            self._pending.pop(key, None)
            if error is None:
                self._time_io(time.perf_counter() - started, len(data))
                self._index[key] = slot
                self.bytes_written += len(data)
            else:
                self._free.append(slot)
                cause = errno.errorcode.get(error.errno, "other")
                first_of_its_cause = cause not in self.write_errors_by_cause
                self.write_errors_by_cause[cause] += 1
        if first_of_its_cause:
            logger.warning("KV tier %s: a write failed with %s (%s); blocks that fail to write are skipped and "
                           "counted (pagellm:kv_offload_write_errors_total{cause=\"%s\"}), and serving goes "
                           "on", self.path, cause, error.strerror, cause)


class RunnerTier:
    """The coordinator's view (core/kv/tiered.py's BlockTier) of the tiers the runner's ranks keep:
    a block loads only if every rank holds its shard, and the bytes wait in the runners for the
    promotion that writes them (ModelRunner.stage_tier_block). `ranks` is the executor that runs
    them (pagellm/executor/base.py: stage_tier_block on every rank)."""

    def __init__(self, ranks) -> None:
        self.ranks = ranks

    def load(self, key: bytes) -> bool | None:
        return True if self.ranks.stage_tier_block(key) else None


def model_fingerprint(model_path: str, arch_config: dict, kv_format: str, block_size: int, block_bytes: int) -> bytes:
    """16 bytes that change with anything that changes a block's bytes: the model (its config,
    and its files' names and sizes), the KV format, the block size and layout."""
    import json

    files = [model_path] if os.path.isfile(model_path) else sorted(
        os.path.join(model_path, f) for f in os.listdir(model_path))
    sizes = [(os.path.basename(f), os.path.getsize(f)) for f in files if os.path.isfile(f)]
    text = json.dumps({"config": arch_config, "files": sizes, "kv_format": kv_format, "block_size": block_size,
                       "block_bytes": block_bytes, "layout": 1}, sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=16).digest()
