"""Byte ranges of one remote object: coalesced into few requests, fetched ahead concurrently, bounded memory.

A deep check reads every chunk of a data file in offset order. Locally that is a front-to-back read; on object
storage each request costs a round trip, so neighbouring ranges (adjacent, or apart by at most ``MAX_GAP``) are
merged into requests of up to ``MAX_REQUEST`` bytes, and up to ``WORKERS`` requests run at once while the
bytes fetched and not yet consumed stay under ``MAX_IN_FLIGHT`` (a request larger than that runs alone).
"""

from __future__ import annotations

import bisect
import os
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from concurrent.futures import Future, ThreadPoolExecutor

    from ckptdoctor.storage.interface import ObjectStore

MAX_GAP = 256 << 10  # bytes between two ranges read rather than paid for with a second request
MAX_REQUEST = 16 << 20
MAX_IN_FLIGHT = 128 << 20
WORKERS = 8

_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def _forget_pool() -> None:  # a forked worker has the parent's pool object but none of its threads
    global _POOL, _POOL_LOCK
    _POOL, _POOL_LOCK = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_pool)


def pool() -> ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            from concurrent.futures import ThreadPoolExecutor

            _POOL = ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="ckptdoctor-get")
        return _POOL


def coalesce(
    ranges: list[tuple[int, int]], max_gap: int = MAX_GAP, max_request: int = MAX_REQUEST
) -> list[tuple[int, int]]:
    """(start, end) requests covering ``ranges`` (sorted by offset): neighbours at most ``max_gap`` apart are
    merged while the request stays within ``max_request`` bytes (a single longer range is one request)."""
    out: list[tuple[int, int]] = []
    for offset, length in ranges:
        end = offset + length
        if out:
            start, last = out[-1]
            if offset >= start and offset - last <= max_gap and max(end, last) - start <= max_request:
                out[-1] = (start, max(end, last))
                continue
        out.append((offset, end))
    return out


class Prefetcher:
    """Requests for the coming reads of one object, fetched ahead; :meth:`take` serves a read from them."""

    def __init__(self, store: ObjectStore, key: str, ranges: list[tuple[int, int]], size: int) -> None:
        self.store = store
        self.key = key
        self.requests = [(s, min(e, size)) for s, e in coalesce(sorted(ranges)) if s < size]
        self.futures: dict[int, Future[bytes]] = {}
        self.first = 0  # index of the first request not yet passed by the reader
        self.submitted = 0  # requests [0, submitted) were started
        self.held = 0  # bytes of started requests not yet passed

    def _top_up(self) -> None:
        while self.submitted < len(self.requests):
            start, end = self.requests[self.submitted]
            if self.held and self.held + (end - start) > MAX_IN_FLIGHT:
                return
            self.futures[self.submitted] = pool().submit(self.store.read_range, self.key, start, end - start)
            self.held += end - start
            self.submitted += 1

    def take(self, offset: int, length: int) -> bytes | None:
        """The bytes of [offset, offset + length) if a planned request covers them, else None."""
        while self.first < len(self.requests) and self.requests[self.first][1] <= offset:
            self._drop(self.first)
            self.first += 1
        if self.first >= len(self.requests):
            return None
        start, end = self.requests[self.first]
        if offset < start or offset + length > end:
            return None
        self._top_up()
        data = self.futures[self.first].result()
        return data[offset - start : offset - start + length]

    def _drop(self, index: int) -> None:
        future = self.futures.pop(index, None)
        if future is not None:
            future.cancel()
            start, end = self.requests[index]
            self.held -= end - start

    def close(self) -> None:
        for index in list(self.futures):
            self._drop(index)


class PlannedReads:
    """Ranges of one object a reader will ask for in any order (``diff --values``: chunks of a run of keys).

    Touching ranges are merged into requests (no gap bytes); the first read inside a request GETs all of it
    (and starts the next one), and a request is dropped once each of its ranges was read, so every planned
    range crosses the wire once.
    Requests held per object stay under two requests' size (the oldest is dropped first; a range of it read
    later is fetched again).
    """

    def __init__(self, store: ObjectStore, key: str, ranges: list[tuple[int, int]], size: int) -> None:
        self.store = store
        self.key = key
        wanted = sorted({(o, n) for o, n in ranges if n > 0 and o + n <= size})
        # only touching ranges merge: bytes between them may be another worker's (each crosses once)
        self.requests = coalesce(wanted, max_gap=0)
        self.starts = [s for s, _ in self.requests]
        self.left = [0] * len(self.requests)  # planned ranges not yet read, per request
        for offset, _ in wanted:
            self.left[bisect.bisect_right(self.starts, offset) - 1] += 1
        self.held: OrderedDict[int, Future[bytes]] = OrderedDict()
        self.held_bytes = 0
        self.lock = threading.Lock()

    def _fetch(self, index: int) -> Future[bytes]:
        future = self.held.get(index)
        if future is None:
            start, end = self.requests[index]
            while self.held and self.held_bytes + (end - start) > 2 * MAX_REQUEST:
                old, _ = self.held.popitem(last=False)
                self.held_bytes -= self.requests[old][1] - self.requests[old][0]
            future = self.held[index] = pool().submit(self.store.read_range, self.key, start, end - start)
            self.held_bytes += end - start
        return future

    def take(self, offset: int, length: int) -> bytes | None:
        """The bytes of a planned range (None for one not planned: the caller reads it on its own)."""
        index = bisect.bisect_right(self.starts, offset) - 1
        if index < 0 or offset + length > self.requests[index][1] or not self.left[index]:
            return None
        with self.lock:
            future = self._fetch(index)
            if index + 1 < len(self.requests) and self.left[index + 1]:
                self._fetch(index + 1)  # read ahead: the next request is usually next
        start = self.requests[index][0]
        data = future.result()[offset - start : offset - start + length]
        with self.lock:
            self.left[index] -= 1
            if not self.left[index] and self.held.pop(index, None) is not None:
                self.held_bytes -= self.requests[index][1] - start
        return data

    def close(self) -> None:
        with self.lock:
            for future in self.held.values():
                future.cancel()
            self.held.clear()
