"""`FrozenMap`: a read-only, hashable mapping for the fields of frozen plans.

Why: a frozen dataclass is only as immutable as its fields. `types.MappingProxyType` is
read-only but not hashable (so a plan holding one cannot be hashed or used as a cache key),
and a plain dict can be changed by whoever holds it. A FrozenMap keeps its items as a tuple
of pairs (the order they were given in, as a dict's), answers lookups through a private dict
built once, and hashes and compares by its items.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import TypeVar

K = TypeVar("K")
V = TypeVar("V")


class FrozenMap(Mapping[K, V]):
    """An immutable mapping: no item assignment, hashable when its keys and values are."""

    __slots__ = ("_d", "_items")

    def __init__(self, items: Mapping[K, V] | Iterable[tuple[K, V]] = ()) -> None:
        d = dict(items)
        object.__setattr__(self, "_d", d)
        object.__setattr__(self, "_items", tuple(d.items()))

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"FrozenMap is immutable (cannot set {name})")

    def __getitem__(self, key: K) -> V:
        return self._d[key]

    def __iter__(self) -> Iterator[K]:
        return iter(self._d)

    def __len__(self) -> int:
        return len(self._d)

    def __contains__(self, key: object) -> bool:
        return key in self._d

    def __hash__(self) -> int:
        return hash(self._items)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, FrozenMap):
            return self._items == other._items
        return isinstance(other, Mapping) and dict(self._d) == dict(other)

    def __reduce__(self) -> tuple[type, tuple[tuple[tuple[K, V], ...]]]:
        # rebuilt from its items (pickle and copy would otherwise set the slots directly)
        return (FrozenMap, (self._items,))

    def __repr__(self) -> str:
        return f"FrozenMap({dict(self._d)!r})"

    @property
    def pairs(self) -> tuple[tuple[K, V], ...]:
        """The items, in order, as a tuple of pairs."""
        return self._items
