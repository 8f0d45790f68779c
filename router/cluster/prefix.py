"""A snapshot of an append-only list that costs nothing to take: its first n items, read from the
list itself. The disaggregated backend yields one per choice on every new token; copying the
token ids, logprobs and prompt each time instead made a request's cost quadratic in its length.
Sound only because what it views is never changed below n: a Choice's token_ids and logprobs
are only appended to (disagg_request.merge), and a request's prompt is never changed."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class Prefix(Sequence):
    __slots__ = ("_items", "_n")

    def __init__(self, items: list, n: int | None = None):
        self._items = items
        self._n = len(items) if n is None else n

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return self._items[:self._n][index] if index.step not in (None, 1) else \
                self._items[slice(*index.indices(self._n))]
        if not -self._n <= index < self._n:
            raise IndexError("Prefix index out of range")
        return self._items[index % self._n]

    def __iter__(self):
        items = self._items
        for i in range(self._n):
            yield items[i]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, (list, tuple, Prefix)):
            return NotImplemented
        return len(other) == self._n and all(a == b for a, b in zip(self, other))

    __hash__ = None

    def __repr__(self) -> str:
        return repr(list(self))
