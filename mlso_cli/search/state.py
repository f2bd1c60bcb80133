"""The abstract-expression tables as one state that can be saved and restored.

Why: terms are interned in module-wide tables (terms.py, target.py, abstract.py), and a pattern
key breaks ties between alpha-equivalent children by their intern order. Left alone, what a
signature's exploration computes would depend on what the same process computed before (which
signatures a pool worker happened to take, which region came first), and state counts, and in
rare ties the pruning itself, would change from run to run. So each region's target is built from
the pristine tables, and every signature's exploration starts from the tables as they stood right
after that build: the same state in every process, whatever ran there before, for any --jobs.

Tables only grow (lists append, dicts insert), so a saved state is their sizes: restoring pops
what was added since, newest first. The consequence for callers: a search invalidates term ids
(abstract expressions, Targets) built before it in the same process; they are the search's
internal currency, and nothing outside `search/` keeps them.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass
from typing import Any

from mlso_cli.search import abstract, target, terms

_TABLES: tuple[tuple[Any, str], ...] = (
    (terms, "_T"),
    (terms, "_ID"),
    (terms, "_SIZE"),
    (terms, "_DEPS"),
    (terms, "_HEIGHT"),
    (terms, "_OCC"),
    (terms, "_ERASED"),
    (terms, "_MUL"),
    (terms, "_ADJ"),
    (terms, "_SUBST"),
    (terms, "_MERGE"),
    (terms, "_NEAR"),
    (target, "_KEY"),
    (target, "_FORM"),
    (target, "_LOCAL"),
    (abstract, "_POS"),
)


@dataclass(frozen=True)
class Saved:
    sizes: tuple[int, ...]
    fresh: int
    extra: tuple[tuple[dict, int], ...] = ()


def save(*extra: dict) -> Saved:
    """The tables' state now; `extra` dicts (a target's admits memo) are restored with them."""
    fresh = next(terms._FRESH)
    terms._FRESH = itertools.count(fresh)
    return Saved(
        tuple(len(getattr(m, name)) for m, name in _TABLES),
        fresh,
        tuple((d, len(d)) for d in extra),
    )


def restore(saved: Saved) -> None:
    for (m, name), n in zip(_TABLES, saved.sizes):
        _truncate(getattr(m, name), n)
    for d, n in saved.extra:
        _truncate(d, n)
    terms._FRESH = itertools.count(saved.fresh)


def _truncate(table: Any, n: int) -> None:
    if isinstance(table, list):
        del table[n:]
        return
    extra = len(table) - n
    if extra > 4 * n:
        # nearly all of it goes: rebuilding the kept prefix is cheaper than popping
        kept = list(itertools.islice(table.items(), n))
        table.clear()
        table.update(kept)
        return
    if extra > 0:
        # pop the newest `extra` items in a loop that runs in C (starmap over popitem): a
        # Python `while` loop popping one by one was about 4x slower, and this runs before
        # every signature's exploration, on tables of hundreds of thousands of entries
        deque(itertools.starmap(table.popitem, itertools.repeat((), extra)), maxlen=0)


PRISTINE = save()
"""The tables as importing the modules left them."""
