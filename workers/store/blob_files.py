"""One file per stored prefix: written whole under a temporary name, read back in one sequential pass.

Primitives:
- ``BlobFiles(folder, create=True)``: the files of a disk tier, named by write sequence number
  (``<seq:016x>.kv``).
  - ``write(seq, blob)``: write under a temporary name, then rename: a file under its final name
    was written whole by the time its index record exists (the index is written after it).
  - ``read(seq, size, alloc=None) -> BlobRead | None``: ``size`` bytes of file ``seq`` (None when
    it does not exist), read into ``alloc(n)`` (a writable buffer of ``n`` bytes; default a fresh
    page-aligned one) with ``O_DIRECT`` where the buffer and filesystem allow (the page cache
    would only duplicate the host tier above), the CRC-32 of all but its last 4 bytes computed
    while the next chunk is read (the codec's checksum: ``kv_codec.decode(..., body_crc=)``).
  - ``delete(seq)``, ``seqs()`` (the sequence numbers present), ``remove_temporaries()``,
    ``drop_cached(seq)`` (``posix_fadvise(DONTNEED)``: a benchmark's cold read).
- ``aligned_buffer(nbytes) -> torch.Tensor``: a fresh page-aligned uint8 tensor of ``nbytes``.
- ``RecyclingBuffers(keep=2)``: ``alloc(n)`` for reads whose buffer becomes the prefix's memory
  (a CPU device): a buffer comes back once nothing views it any more, so its pages are already
  mapped (a fresh buffer costs a page fault per 4 kB during the read: on a busy machine more
  than the read itself). It holds at most ``keep`` buffers.
- ``BlobRead``: ``blob`` (a memoryview of exactly the file's bytes), ``body_crc``, ``direct``.
- ``ALIGN``: the alignment ``O_DIRECT`` needs of buffers, offsets and lengths.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from relaygr.workers.store.kv_codec import crc32

ALIGN = 4096
CHUNK = 16 << 20  # one read request: large enough to stream, small enough to overlap the checksum
_SUFFIX = ".kv"
_TEMP = ".tmp"
_CRC_BYTES = 4

Alloc = Callable[[int], memoryview]


def round_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def aligned_buffer(nbytes: int) -> torch.Tensor:
    """A fresh uint8 tensor of ``nbytes`` whose first byte is ``ALIGN``-aligned."""
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
    start = (-raw.data_ptr()) % ALIGN
    return raw[start : start + nbytes]


def _fresh(n: int) -> memoryview:
    return memoryview(aligned_buffer(n).numpy())


class RecyclingBuffers:
    _FREE_REFS = 3  # the pool's list, the loop's name and getrefcount's own argument

    def __init__(self, keep: int = 2) -> None:
        self.keep = keep
        self._pool: list[np.ndarray] = []
        self._lock = threading.Lock()

    def alloc(self, n: int) -> memoryview:
        with self._lock:
            for arr in self._pool:
                # Every view handed out (and every tensor decoded into it) holds a reference.
                if arr.nbytes >= n and sys.getrefcount(arr) <= self._FREE_REFS:
                    return memoryview(arr)[:n]
            arr = aligned_buffer(round_up(n)).numpy()
            free = [a for a in self._pool if sys.getrefcount(a) <= self._FREE_REFS]
            if len(self._pool) >= self.keep and free:
                self._pool.remove(min(free, key=lambda a: a.nbytes))
            if len(self._pool) < self.keep:
                self._pool.append(arr)
            return memoryview(arr)[:n]


@dataclass(frozen=True)
class BlobRead:
    blob: memoryview
    body_crc: int  # CRC-32 of blob[:-4]
    direct: bool  # read with O_DIRECT (bypassing the page cache)


def _address(view: memoryview) -> int:
    return torch.frombuffer(view, dtype=torch.uint8).data_ptr() if len(view) else 0


class BlobFiles:
    """See the module docstring. ``read`` may run on any thread; ``write`` and ``delete`` on one."""

    def __init__(self, folder: str | os.PathLike[str], *, create: bool = True) -> None:
        self.folder = os.fspath(folder)
        if create:
            os.makedirs(self.folder, exist_ok=True)
        self._prefetch: ThreadPoolExecutor | None = None  # started by the first read
        self._prefetch_lock = threading.Lock()

    def path(self, seq: int) -> str:
        return os.path.join(self.folder, f"{seq:016x}{_SUFFIX}")

    def seqs(self) -> set[int]:
        out = set()
        for name in os.listdir(self.folder):
            if name.endswith(_SUFFIX):
                try:
                    out.add(int(name[: -len(_SUFFIX)], 16))
                except ValueError:
                    continue
        return out

    def remove_temporaries(self) -> None:
        """Delete files a crash left half written (they never got their final name)."""
        for name in os.listdir(self.folder):
            if name.endswith(_TEMP):
                os.unlink(os.path.join(self.folder, name))

    def write(self, seq: int, blob: bytes | memoryview) -> None:
        final = self.path(seq)
        temp = final + _TEMP
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view, done = memoryview(blob), 0
            while done < len(view):
                done += os.write(fd, view[done:])
        finally:
            os.close(fd)
        os.replace(temp, final)

    def delete(self, seq: int) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path(seq))

    def drop_cached(self, seq: int) -> None:
        """Drop the file's pages from the page cache (its next buffered read is a cold one)."""
        fd = os.open(self.path(seq), os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages cannot be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)

    def read(self, seq: int, size: int, alloc: Alloc | None = None) -> BlobRead | None:
        buf = (alloc or _fresh)(round_up(size))
        if len(buf) < size:
            raise ValueError(f"read buffer of {len(buf)} bytes for a blob of {size}")
        direct = len(buf) >= round_up(size) and _address(buf) % ALIGN == 0
        try:
            fd = self._open(seq, direct)
            if fd < 0:
                direct, fd = False, os.open(self.path(seq), os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            if not direct:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            got, crc = self._read_checksummed(fd, buf, round_up(size) if direct else size, size)
        finally:
            os.close(fd)
        return BlobRead(buf[: min(got, size)], crc, direct)

    def _open(self, seq: int, direct: bool) -> int:
        """The file opened with O_DIRECT; -1 when it must be read through the page cache."""
        if not direct or not hasattr(os, "O_DIRECT"):
            return -1
        try:
            return os.open(self.path(seq), os.O_RDONLY | os.O_DIRECT)
        except OSError as e:
            if isinstance(e, FileNotFoundError):
                raise
            return -1  # a filesystem without O_DIRECT (tmpfs)

    def _read_checksummed(self, fd: int, buf: memoryview, want: int, size: int) -> tuple[int, int]:
        """Read up to ``want`` bytes from offset 0, checksumming ``[0, size - 4)`` of what arrived
        while the next chunk is being read. Returns (bytes read, CRC)."""
        body_end = max(0, size - _CRC_BYTES)
        crc, got, start = 0, 0, 0
        with self._prefetch_lock:
            if self._prefetch is None:
                self._prefetch = ThreadPoolExecutor(1, thread_name_prefix="prefix-store-disk-prefetch")
            prefetch = self._prefetch
        pending = prefetch.submit(_pread, fd, buf, 0, min(CHUNK, want))
        while pending is not None:
            n = pending.result()
            end = got + n
            more = n > 0 and end < want
            pending = prefetch.submit(_pread, fd, buf, end, min(end + CHUNK, want)) if more else None
            got = end
            stop = min(got, body_end)
            if stop > start:
                crc = crc32(buf[start:stop], crc)
                start = stop
        return got, crc

    def close(self) -> None:
        with self._prefetch_lock:
            prefetch, self._prefetch = self._prefetch, None
        if prefetch is not None:
            prefetch.shutdown(wait=True)


def _pread(fd: int, buf: memoryview, start: int, stop: int) -> int:
    """Read ``[start, stop)`` of the file into the same range of ``buf``; fewer bytes at its end."""
    done = start
    while done < stop:
        n = os.preadv(fd, [buf[done:stop]], done)
        if n == 0:
            break
        done += n
    return done - start
