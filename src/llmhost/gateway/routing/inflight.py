"""Requests in flight per routing target, as the routing policies read them.

A gateway of one process counts its own requests (``InFlight``). With several workers
(``llmhost gateway --workers N``) each worker sees only the requests the kernel gave
it, about 1/N of the host's: a load bound over counts that small moves a request off
its prefix's replica whenever a few of one worker's requests happen to share a
replica. ``SharedInFlight`` counts over every worker of the host instead, in a table
the supervisor creates and every worker maps (``mmap`` of one file in the
supervisor's private folder):

- one row per worker, written by that worker only: ``SLOTS`` pairs of (a 64-bit hash
  of the target's name, its requests in flight from that worker);
- a worker reads a target's count as the sum of every row's pair for that hash (each
  value an aligned 64-bit word, written and read whole);
- the supervisor zeroes a worker's row when the worker ends (its requests ended with
  it), and a worker zeroes its own row when it starts.

The routing order itself never depends on these counts (rendezvous hashing of the
key); only the load bound and the least-loaded choice do, so gateways on other hosts
still pick the same replica for a key while their loads are under the bound.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import mmap
import os
from collections.abc import Iterator
from pathlib import Path

# Targets one worker can count in the shared table: upstreams and engine sockets (one per
# model instance). Past that, a target is counted by its worker only.
SLOTS = 1024
_WORD = ctypes.sizeof(ctypes.c_int64)
_PAIR = 2  # words per slot: name hash, count


@functools.lru_cache(maxsize=4096)
def name_hash(name: str) -> int:
    """A target's 64-bit id in the shared table (never 0, which marks a free slot)."""
    digest = hashlib.blake2b(name.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True) | 1


def upstream_load_name(target: str) -> str:
    """An upstream's name in the counts (its ``host:port``)."""
    return "upstream\0" + target


def socket_load_name(path: Path) -> str:
    """An engine socket's name in the counts: its path (a model's folder of sockets on this host)."""
    return "socket\0" + str(path)


def _row_start(row: int) -> int:
    """Where ROW begins in the table, in words (so ``_row_start(1)`` is a row's length)."""
    return row * SLOTS * _PAIR


def table_bytes(rows: int) -> int:
    return _row_start(rows) * _WORD


def create_table(path: Path, rows: int) -> None:
    """A zeroed table for ROWS workers at PATH, readable and writable by this user only."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.ftruncate(fd, table_bytes(rows))
    finally:
        os.close(fd)


def clear_row(path: Path, row: int) -> None:
    """Zero ROW of the table at PATH: the worker that wrote it has ended."""
    with open(path, "r+b") as f:
        f.seek(_row_start(row) * _WORD)
        f.write(bytes(_row_start(1) * _WORD))


def _find(words: ctypes.Array[ctypes.c_int64], base: int, key: int) -> int | None:
    """The slot of KEY in the row at BASE, or None: its used slots come first."""
    for slot in range(SLOTS):
        found = words[base + slot * _PAIR]
        if found == key:
            return slot
        if found == 0:
            return None
    return None


def counts_by_row(path: Path, name: str) -> list[int]:
    """NAME's requests in flight in each row of the table at PATH: each worker's share."""
    data = path.read_bytes()
    words = (ctypes.c_int64 * (len(data) // _WORD)).from_buffer_copy(data)
    key = name_hash(name)
    out = []
    for row in range(len(data) // table_bytes(1)):
        slot = _find(words, _row_start(row), key)
        out.append(0 if slot is None else words[_row_start(row) + slot * _PAIR + 1])
    return out


class InFlight:
    """Requests in flight per target name, counted by this process."""

    def __init__(self) -> None:
        self._own: dict[str, int] = {}

    def add(self, name: str, delta: int) -> None:
        self._own[name] = self._own.get(name, 0) + delta

    def count(self, name: str) -> int:
        """NAME's requests in flight (this process's, or the host's where shared)."""
        return self._own.get(name, 0)

    @contextlib.contextmanager
    def holding(self, name: str) -> Iterator[None]:
        """NAME has one more request in flight for the duration."""
        self.add(name, 1)
        try:
            yield
        finally:
            self.add(name, -1)


class SharedInFlight(InFlight):
    """Requests in flight per target, summed over every worker's row of the table at PATH;
    this process writes row ROW."""

    def __init__(self, path: Path, row: int) -> None:
        super().__init__()
        size = os.path.getsize(path)
        self.rows = size // table_bytes(1)
        if size != table_bytes(self.rows) or not 0 <= row < self.rows:
            raise ValueError(f"{path}: not a table with a row {row} ({size} bytes)")
        self.row = row
        with open(path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), size)
        self._words = (ctypes.c_int64 * (size // _WORD)).from_buffer(self._map)
        self._slot: dict[str, int] = {}  # name -> its slot in this process's row
        self._seen: dict[tuple[int, int], int] = {}  # (row, name hash) -> the slot it was last found in
        base = _row_start(row)
        for i in range(_row_start(1)):  # what a predecessor in this row left
            self._words[base + i] = 0

    def _own_slot(self, name: str) -> int | None:
        """NAME's slot in this process's row: the next unused one (a row fills from its
        start, so readers stop at the first free slot), or once all are used one whose
        target has nothing in flight now; None when every slot is busy."""
        slot = self._slot.get(name)
        if slot is not None:
            return slot
        base, words = _row_start(self.row), self._words
        if len(self._slot) < SLOTS:
            slot = len(self._slot)
        else:
            slot = next((s for s in range(SLOTS) if words[base + s * _PAIR + 1] == 0), None)
            if slot is None:
                return None
            del self._slot[next(n for n, s in self._slot.items() if s == slot)]
        words[base + slot * _PAIR + 1] = 0
        words[base + slot * _PAIR] = name_hash(name)
        self._slot[name] = slot
        return slot

    def add(self, name: str, delta: int) -> None:
        super().add(name, delta)
        slot = self._own_slot(name)
        if slot is not None:
            self._words[_row_start(self.row) + slot * _PAIR + 1] = self._own[name]

    def count(self, name: str) -> int:
        total = self._own.get(name, 0)
        key, words = name_hash(name), self._words
        for row in range(self.rows):
            if row == self.row:
                continue
            base = _row_start(row)
            slot = self._seen.get((row, key))
            if slot is None or words[base + slot * _PAIR] != key:
                slot = _find(words, base, key)
                if slot is None:
                    self._seen.pop((row, key), None)
                    continue
                self._seen[(row, key)] = slot
            total += max(0, words[base + slot * _PAIR + 1])
        return total

    def close(self) -> None:
        del self._words
        self._map.close()
