"""Bin packing of integer lengths into packs of a fixed capacity.

`best_fit_decreasing` is exact best-fit-decreasing (every item, largest first, goes into the open pack with the
least room that still fits it; a new pack when none does), computed group-wise: lengths are integers <= capacity,
so all items of one length are placed together. Best fit sends consecutive items of length `s` into the same pack
until its room drops below `s` (the room it is left with is smaller than any other fitting pack's), so a pack with
room `r` takes `r // s` of them, and the packs with the same room can be handled as one group. Open packs are kept
by remaining room (a sorted list of rooms, each with its packs as numpy chunks); a group walks the rooms from the
smallest that fits upwards and touches only rooms whose packs receive items. Python work is per distinct length
and per room touched, numpy moves the pack ids: 10M lengths take seconds on one core (bench/pack.py), where TRL's
per-item loop over a segment tree needs minutes for 1M.

`first_fit_decreasing` (each item into the first-opened pack that fits) is the classic baseline; it runs one
Python loop per item over a max-segment-tree of packs and is here for comparison (bench/pack.py).

Both return the pack index of every item (packs numbered in the order they are opened), and are deterministic:
ties between equal lengths keep the input order, ties between equally full packs go to the earlier-opened one.
"""

from __future__ import annotations

import bisect

import numpy as np


def _check(lengths, capacity: int) -> np.ndarray:
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.ndim != 1:
        raise ValueError("lengths must be a 1-D array")
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1, got {capacity}")
    if lengths.size and (lengths.min() < 1 or lengths.max() > capacity):
        raise ValueError(f"every length must be in [1, {capacity}] (got min {lengths.min()}, max {lengths.max()})")
    return lengths


class _Placed:
    """The pack of each item in sorted order, appended in runs: short runs go to a Python list (a numpy call costs
    microseconds, a list append tens of nanoseconds), long ones as numpy arrays."""

    LONG = 256

    def __init__(self) -> None:
        self.chunks: list[np.ndarray] = []
        self.buf: list[int] = []

    def add(self, packs: np.ndarray, per_pack: int) -> None:
        """Each of `packs` takes `per_pack` consecutive items."""
        if packs.size * per_pack >= self.LONG:
            self._flush()
            self.chunks.append(np.repeat(packs, per_pack))
        elif per_pack == 1:
            self.buf += packs.tolist()
        else:
            for p in packs.tolist():
                self.buf += [p] * per_pack

    def array(self) -> np.ndarray:
        self._flush()
        return np.concatenate(self.chunks)

    def _flush(self) -> None:
        if self.buf:
            self.chunks.append(np.asarray(self.buf, dtype=np.int64))
            self.buf = []


class _Rooms:
    """Open packs grouped by remaining room: `levels` is the sorted list of rooms that have packs, `ids[r]` the
    packs with room r (numpy chunks: moving a whole group costs one append, not one step per pack)."""

    def __init__(self) -> None:
        self.ids: dict[int, list[np.ndarray]] = {}
        self.levels: list[int] = []

    def put(self, room: int, packs: np.ndarray) -> None:
        if packs.size:
            chunks = self.ids.get(room)
            if chunks is None:
                self.ids[room] = [packs]
                bisect.insort(self.levels, room)
            else:
                chunks.append(packs)

    def take_all(self, room: int) -> np.ndarray:
        """Every pack with this room, in opening order (ties go to the earliest-opened pack); the caller removes
        `room` from `levels`."""
        chunks = self.ids.pop(room)
        return chunks[0] if len(chunks) == 1 else np.sort(np.concatenate(chunks))


def best_fit_decreasing(lengths, capacity: int) -> np.ndarray:
    """Pack index of every item under best-fit-decreasing; see the module docstring for the method."""
    lengths = _check(lengths, capacity)
    n = lengths.size
    if n == 0:
        return np.empty(0, dtype=np.int64)
    # Largest first, equal lengths in input order. A stable sort of 16-bit keys is a radix sort in numpy: O(n).
    key = (capacity - lengths).astype(np.uint16 if capacity < 1 << 16 else np.int64)
    order = np.argsort(key, kind="stable")
    sorted_lengths = lengths[order]
    starts = np.concatenate([[0], np.flatnonzero(sorted_lengths[1:] != sorted_lengths[:-1]) + 1])
    sizes = sorted_lengths[starts].tolist()
    counts = np.diff(np.append(starts, n)).tolist()
    rooms, placed = _Rooms(), _Placed()
    levels = rooms.levels
    n_packs = 0
    for s, left in zip(sizes, counts):
        moves: list[tuple[int, np.ndarray]] = []
        i = j = bisect.bisect_left(levels, s)
        while left and j < len(levels):  # rooms that fit s, smallest first: a pack with room r takes r // s items
            r = levels[j]
            packs, per_pack = rooms.take_all(r), r // s
            j += 1
            if packs.size * per_pack <= left:  # every pack of this room fills up (to room r % s)
                placed.add(packs, per_pack)
                moves.append((r % s, packs))
                left -= packs.size * per_pack
                continue
            k, rem = divmod(left, per_pack)  # the group runs out here: k packs fill up, the next takes the rest
            placed.add(packs[:k], per_pack)
            moves += [(r % s, packs[:k]), (r, packs[k + (1 if rem else 0) :])]
            if rem:
                placed.add(packs[k : k + 1], rem)
                moves.append((r - rem * s, packs[k : k + 1]))
            left = 0
        del levels[i:j]
        for room, packs in moves:
            rooms.put(room, packs)
        if left:  # no open pack fits: new packs take capacity // s items each
            per_pack = capacity // s
            k, rem = divmod(left, per_pack)
            new = np.arange(n_packs, n_packs + k + (1 if rem else 0), dtype=np.int64)
            n_packs += new.size
            placed.add(new[:k], per_pack)
            rooms.put(capacity - per_pack * s, new[:k])
            if rem:
                placed.add(new[k:], rem)
                rooms.put(capacity - rem * s, new[k:])
    assign = np.empty(n, dtype=np.int64)
    assign[order] = placed.array()
    return assign


def first_fit_decreasing(lengths, capacity: int) -> np.ndarray:
    """Pack index of every item under first-fit-decreasing (the earliest-opened pack with room), the classic
    baseline: a max-segment-tree over packs' remaining room, one Python loop step per item."""
    lengths = _check(lengths, capacity)
    n = lengths.size
    assign = np.empty(n, dtype=np.int64)
    if n == 0:
        return assign
    order = np.argsort(-lengths, kind="stable")
    size = 1
    while size < n:
        size <<= 1
    tree = [0] * (2 * size)  # max remaining room over each range of packs; unopened packs have full room
    for i in range(size, size + n):
        tree[i] = capacity
    for i in range(size - 1, 0, -1):
        a, b = tree[2 * i], tree[2 * i + 1]
        tree[i] = a if a >= b else b
    n_packs = 0
    for idx, s in zip(order.tolist(), lengths[order].tolist()):
        i = 1
        while i < size:  # leftmost leaf with room >= s
            i = 2 * i if tree[2 * i] >= s else 2 * i + 1
        pack = i - size
        if pack == n_packs:
            n_packs += 1
        assign[idx] = pack
        tree[i] -= s
        i >>= 1
        while i:
            a, b = tree[2 * i], tree[2 * i + 1]
            tree[i] = a if a >= b else b
            i >>= 1
    return assign


def pack_loads(assign: np.ndarray, lengths, n_packs: int | None = None) -> np.ndarray:
    """Tokens in each pack."""
    n = int(assign.max()) + 1 if n_packs is None and assign.size else (n_packs or 0)
    return np.bincount(assign, weights=np.asarray(lengths, dtype=np.float64), minlength=n).astype(np.int64)
