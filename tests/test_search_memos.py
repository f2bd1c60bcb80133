"""Memos on the search's hot paths answer what the uncached computation answers.

Why: `value_classes` (search/dims.py) is asked for every pair the enumeration tries and is now
memoised on (op, arg, source classes, rank); a memo that answered a different question (a key
missing a field) would silently change which candidates are typed out, and with them the
search's state counts. Checked on random class tuples, twice (the second answer from the memo),
against the rule table called directly.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from mlso_cli.ir.ops import Op
from mlso_cli.search import dims
from mlso_cli.search.space import ROW

classes = st.lists(st.one_of(st.none(), st.integers(0, 3)), min_size=0, max_size=4).map(tuple)
ops = st.sampled_from(
    [Op.ADD, Op.MUL, Op.EXP, Op.MATMUL, Op.REDUCE_SUM, Op.TRANSPOSE, Op.RESHAPE, Op.ACC_SUM,
     Op.ACC_EXP_SUM, Op.ACC_EXP_WSUM, Op.CONST, Op.BROADCAST]
)  # fmt: skip
args = st.one_of(
    st.none(),
    st.integers(0, 3),
    st.just(ROW),
    st.permutations([0, 1, 2]).map(tuple),
    st.just([0, 1]),  # unhashable: answered without the memo
)


@settings(max_examples=400, deadline=None)
@given(op=ops, arg=args, srcs=st.lists(classes, min_size=1, max_size=2), rank=st.integers(0, 5))
def test_value_classes_memo_matches_the_rules(op, arg, srcs, rank):
    def answer(f):
        try:
            return f(op, arg, list(srcs), rank)
        except ValueError as exc:  # operands of the wrong arity: raised with or without the memo
            return type(exc)

    want = answer(dims._value_classes)
    assert answer(dims.value_classes) == want
    assert answer(dims.value_classes) == want  # from the memo this time


@settings(max_examples=200, deadline=None)
@given(kept=st.integers(0, 60), added=st.integers(0, 400))
def test_truncate_keeps_the_prefix_in_order(kept, added):
    """state._truncate (popping in C, or rebuilding when nearly all goes) leaves exactly the
    first `kept` items in insertion order, as popping one by one did; lists likewise."""
    from mlso_cli.search import state

    d = {(i * 7919) % 1009 + i * 1009: i for i in range(kept + added)}
    want = list(d.items())[:kept]
    state._truncate(d, kept)
    assert list(d.items()) == want
    d[-1] = -1  # still a working dict: new items go after the kept ones
    assert list(d)[-1] == -1
    xs = list(range(kept + added))
    state._truncate(xs, kept)
    assert xs == list(range(kept))
