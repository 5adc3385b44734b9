"""Blend planning on the host (chunkwise/engine/blend/planning.py and policy.py): the plan each policy makes of one
prompt against a stand-in pool holding its chunks' full pages, no model. Every policy finds the same candidates;
"adaptive" plans kv-deviation's budget (the same check layers and keep counts k(r_l) of all the candidates) and
groups each candidate by its chunk piece, so that the check layers share those places among the chunks
(chunkwise/engine/row_plan.py, `group_scores`); r = 0 checks nothing and computes no candidate, r = 1 keeps them all.
"""
from __future__ import annotations

import numpy as np
import pytest

from chunkwise.chunks import Blend, Chunk, Piece
from chunkwise.engine.blend import check_ratios, num_kept, plan_blend

pytestmark = pytest.mark.correctness

A, B = Chunk(tuple(range(3, 12)), 0, "stand-in"), Chunk(tuple(range(20, 33)), 1, "stand-in")
# [text 3, A 9 (two full pages of 4), text 2, B 13 (three full pages), text 3]: 30 rows
PIECES = (Piece(None, 3), Piece(A, 9), Piece(None, 2), Piece(B, 13), Piece(None, 3))
LAYERS = 6


class StandInPool:
    """The prefix cache as plan_blend reads it: each chunk's full pages, cached under its own tokens."""
    page_size = 4

    def chain_pages(self, token_ids) -> list[int]:
        return {A.token_ids: [10, 11], B.token_ids: [20, 21, 22]}[tuple(token_ids)]


def plan(blend: Blend, start: int = 0):
    return plan_blend(blend, PIECES, start, StandInPool(), LAYERS).rows


@pytest.mark.parametrize("ratio", [0.05, 0.3, 0.5])
def test_an_adaptive_plan_is_kv_deviations_budget_with_each_candidate_grouped_by_its_chunk_piece(ratio):
    adaptive, kv = plan(Blend(ratio, "adaptive")), plan(Blend(ratio))
    assert adaptive.check_layers == kv.check_layers == (1, 2, 3)
    assert adaptive.keep == kv.keep == tuple(num_kept(x, 20) for x in check_ratios(ratio, LAYERS))
    for name in ("computed", "placed", "src_slots", "deltas"):
        assert np.array_equal(getattr(adaptive, name), getattr(kv, name)), name
    assert adaptive.groups.tolist() == [-1] * 3 + [1] * 8 + [-1] * 3 + [3] * 12 + [-1] * 4
    assert kv.groups is None and plan(Blend(ratio, "chunk-heads")).groups is None


def test_an_adaptive_plan_after_an_exact_prefix_groups_only_the_rows_it_computes():
    rows = plan(Blend(0.3, "adaptive"), start=7)   # c0 inside A: A's rows from 7 on, all of B's
    assert rows.groups.tolist() == [1] * 4 + [-1] * 3 + [3] * 12 + [-1] * 4
    assert rows.keep == tuple(num_kept(x, 16) for x in check_ratios(0.3, LAYERS))


def test_the_adaptive_budgets_edges_check_nothing_at_zero_and_keep_every_candidate_at_one():
    zero = plan(Blend(0.0, "adaptive"))
    assert zero.check_layers == () and zero.groups is None
    assert not (zero.computed & zero.placed).any() and zero.computed.sum() == 30 - 20
    one = plan(Blend(1.0, "adaptive"))
    assert one.keep == (20, 20, 20) and one.computed.all()
