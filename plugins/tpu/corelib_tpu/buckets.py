"""Batch buckets: the fixed row counts the XLA graphs are compiled for.

A batch of ``n`` rows runs in the smallest bucket ``>= n``; rows past ``n`` are padding with
neutral parameters, so one compiled graph serves every batch size up to its bucket.
"""

from __future__ import annotations

from typing import Iterable, Optional

DEFAULT_MAX_ROWS = 256
SMALLEST_DEFAULT_BUCKET = 8


class Buckets:
    """An ascending tuple of row counts. ``Buckets()`` gives 8, 16, 32, ..., 256."""

    def __init__(self, sizes: Optional[Iterable[int]] = None, max_rows: int = DEFAULT_MAX_ROWS):
        if sizes is None:
            sizes = default_sizes(max_rows)
        sizes = list(sizes)
        for size in sizes:
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"bucket sizes must be positive ints, got {size!r}")
        if not sizes:
            raise ValueError("buckets must hold at least one size, got []")
        self.sizes: tuple[int, ...] = tuple(sorted(set(sizes)))

    @property
    def largest(self) -> int:
        return self.sizes[-1]

    def for_rows(self, rows: int) -> int:
        """The smallest bucket holding ``rows`` rows; ValueError past the largest."""
        for size in self.sizes:
            if size >= rows:
                return size
        raise ValueError(f"{rows} rows exceed the largest bucket ({self.largest}); "
                         f"create the sampler with larger buckets")

    def __iter__(self):
        return iter(self.sizes)

    def __len__(self) -> int:
        return len(self.sizes)

    def __repr__(self) -> str:
        return f"Buckets({list(self.sizes)})"

    def __eq__(self, other) -> bool:
        return isinstance(other, Buckets) and other.sizes == self.sizes

    def __hash__(self) -> int:
        return hash(self.sizes)


def default_sizes(max_rows: int) -> list[int]:
    """8, 16, 32, ... doubling up to ``max_rows`` (itself the last size when not a power of 2)."""
    if isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 1:
        raise ValueError(f"max_rows must be a positive int, got {max_rows!r}")
    sizes, size = [], SMALLEST_DEFAULT_BUCKET
    while size < max_rows:
        sizes.append(size)
        size *= 2
    sizes.append(max_rows)
    return sizes
