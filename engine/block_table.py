"""A sequence's KV block ids, kept as a Python list and as an int32 array.

The block manager and the scheduler work on the list (append, clear, index);
the model runner builds every step's block tables from the array, so a step
copies contiguous int32 rows instead of converting each block id of every
sequence from a Python int again (a batch of 256 sequences at 32k tokens holds
524,288 ids). The two stay equal because the only ways to change a BlockTable
are append, extend and clear; any other list mutation raises.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

_MIN_CAPACITY = 16


class BlockTable(list):
    """list[int] of block ids with `ids`, the same ids as an int32 array."""

    __slots__ = ("_array",)

    def __init__(self, block_ids: Iterable[int] = ()):
        super().__init__(block_ids)
        self._array = np.empty(max(_MIN_CAPACITY, 2 * len(self)), dtype=np.int32)
        self._array[:len(self)] = self

    @property
    def ids(self) -> np.ndarray:
        """[len(self)] int32, a view (valid until the next change)."""
        return self._array[:len(self)]

    def append(self, block_id: int) -> None:
        n = len(self)
        if n == len(self._array):
            self._grow(n + 1)
        self._array[n] = block_id
        super().append(block_id)

    def extend(self, block_ids: Iterable[int]) -> None:
        new = list(block_ids)
        n = len(self)
        if n + len(new) > len(self._array):
            self._grow(n + len(new))
        self._array[n:n + len(new)] = new
        super().extend(new)

    def _grow(self, needed: int) -> None:
        array = np.empty(max(needed, 2 * len(self._array)), dtype=np.int32)
        array[:len(self)] = self._array[:len(self)]
        self._array = array

    def __reduce__(self):
        return BlockTable, (list(self),)

    def _unsupported(self, *args, **kwargs):
        raise TypeError("a BlockTable changes only by append, extend and clear")

    __setitem__ = __delitem__ = __iadd__ = __imul__ = _unsupported
    insert = pop = remove = reverse = sort = _unsupported
