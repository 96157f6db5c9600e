"""``FileStore``: GCache pages as files under one directory, bounded in bytes, LRU-evicted.

    root/ab/cd/abcd...ef      one file per key, named sha256(key).hex(), two levels of fan-out
    root/ab/cd/.tmp-*         a write in progress (same directory, so the final rename is atomic)

A value is written to a temp file and then linked into place: ``os.link`` fails if the name
exists, which makes the put set-if-absent across processes, and a reader only ever opens a
complete file. Several processes may share a root; each keeps its own in-memory LRU index
(key file -> size, rebuilt at open from the files, oldest mtime first) and evicts from it, so the
directory can briefly exceed ``max_bytes`` by what the other processes wrote since they last
looked. A file another process evicted reads as a miss.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

from engine.kv.gcache.store import OutageLog, StoreStats

STALE_TMP_S = 3600.0  # NOTE: a temp file this old was left by a crashed writer


class FileStore:
    """Args:
    root: the directory (created if missing); may be shared with other processes.
    max_bytes: bound on the bytes of stored values; the least recently used go first.
    """

    def __init__(self, root: Path, max_bytes: int) -> None:
        assert max_bytes > 0, f"max_bytes={max_bytes}: must be > 0"
        self.root, self.max_bytes = Path(root), max_bytes
        self.stats = StoreStats()
        self._outage = OutageLog(f"file store {self.root}")
        self._lock = threading.Lock()
        self._index: OrderedDict[str, int] = OrderedDict()  # file name -> bytes, oldest first
        self._total_bytes = 0
        self.root.mkdir(parents=True, exist_ok=True)
        self._scan()

    @property
    def total_bytes(self) -> int:
        return self._total_bytes

    def __len__(self) -> int:
        return len(self._index)

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        self.stats.gets += len(keys)
        values = [self._get(key) for key in keys]
        hits = sum(value is not None for value in values)
        self.stats.hits += hits
        self.stats.misses += len(keys) - hits
        return values

    def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> int:
        self.stats.puts += len(items)
        return sum(self._put(key, value) for key, value in items)

    def exists_many(self, keys: Sequence[bytes]) -> list[bool]:
        return [self._exists(_name(key)) for key in keys]

    def close(self) -> None:
        pass

    def _get(self, key: bytes) -> bytes | None:
        name = _name(key)
        path = self._path(name)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            self._forget(name)
            return None
        except OSError as exc:
            self._failed("read", exc)
            return None
        self._outage.succeeded()
        with self._lock:
            if name in self._index:
                self._index.move_to_end(name)
            else:
                self._adopt(name, len(data))
        # NOTE: mtime carries the LRU order across restarts (the index is rebuilt from it)
        with contextlib.suppress(OSError):
            os.utime(path)
        return data

    def _put(self, key: bytes, value: bytes) -> int:
        name = _name(key)
        if self._exists(name):
            self.stats.skipped_existing += 1
            return 0
        if len(value) > self.max_bytes:
            self.stats.skipped_too_large += 1
            return 0
        with self._lock:
            self._evict_until(self.max_bytes - len(value))
        try:
            written = self._write(self._path(name), value)
        except OSError as exc:
            self._failed("write", exc)
            return 0
        self._outage.succeeded()
        if not written:
            self.stats.skipped_existing += 1
            return 0
        with self._lock:
            self._adopt(name, len(value))
        self.stats.put_bytes += len(value)
        return 1

    def _write(self, path: Path, value: bytes) -> bool:
        """Write ``value`` at ``path`` unless a file is there; False when one was."""
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(value)
            try:
                os.link(tmp, path)
            except FileExistsError:
                return False
            except OSError:
                # NOTE: no hard links on this filesystem: rename (atomic too; a racing writer of
                # the same key may then replace a valid value by another valid one)
                if path.exists():
                    return False
                os.replace(tmp, path)
            return True
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)

    def _exists(self, name: str) -> bool:
        with self._lock:
            if name in self._index:
                return True
        try:
            size = self._path(name).stat().st_size
        except OSError:
            return False
        with self._lock:
            self._adopt(name, size)
        return True

    def _adopt(self, name: str, size: int) -> None:
        """Index a file (written here or by another process). NOTE: only under ``_lock``."""
        if name in self._index:
            return
        self._index[name] = size
        self._total_bytes += size
        self._evict_until(self.max_bytes, keep=name)

    def _evict_until(self, limit: int, keep: str | None = None) -> None:
        """Delete least recently used files until at most ``limit`` bytes remain.
        NOTE: only under ``_lock``."""
        while self._total_bytes > limit and self._index:
            name, size = next(iter(self._index.items()))
            if name == keep:
                if len(self._index) == 1:
                    return
                self._index.move_to_end(name)
                continue
            del self._index[name]
            self._total_bytes -= size
            self.stats.evictions += 1
            with contextlib.suppress(FileNotFoundError):
                self._path(name).unlink()

    def _forget(self, name: str) -> None:
        with self._lock:
            size = self._index.pop(name, None)
            if size is not None:
                self._total_bytes -= size

    def _scan(self) -> None:
        """Rebuild the index from the files, oldest mtime first; drop stale temp files."""
        found: list[tuple[float, str, int]] = []
        now = time.time()
        for path in self.root.glob("*/*/*"):
            with contextlib.suppress(OSError):
                st = path.stat()
                if path.name.startswith(".tmp-"):
                    if now - st.st_mtime > STALE_TMP_S:
                        path.unlink()
                elif len(path.name) == 64:
                    found.append((st.st_mtime, path.name, st.st_size))
        for _, name, size in sorted(found):
            self._index[name] = size
            self._total_bytes += size
        with self._lock:
            self._evict_until(self.max_bytes)

    def _path(self, name: str) -> Path:
        return self.root / name[:2] / name[2:4] / name

    def _failed(self, what: str, exc: OSError) -> None:
        self.stats.errors += 1
        self._outage.failed(what, exc)


def _name(key: bytes) -> str:
    return hashlib.sha256(key).hexdigest()
