"""Row plans (chunkwise/engine/row_plan.py), the feature-neutral seam between the blend package that makes them and
the runner and model that apply them: a step's plans combine into the flat batch's layer-0 rows, placed K/V and
per-check-layer segments as each plan says; a check layer keeps every unplaced row and the placed rows that deviate
most, or, with groups (blend's "adaptive"), exactly as many placed rows shared among the groups by Sainte-Laguë
apportionment of their deviation sums (an independent criterion, and the reference blend's scores bit for bit); a
malformed plan is refused by name. Host and CPU tensors only: no model runs here."""
from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from chunkwise.engine.row_plan import HostRows, RowPlan, RowSelection, group_scores, select_rows, step_rows
from chunkwise.reference.blend import apportioned

pytestmark = pytest.mark.correctness


def plan(computed, placed, check_layers=(), keep=()) -> RowPlan:
    computed, placed = np.array(computed, bool), np.array(placed, bool)
    n = int(placed.sum())
    return RowPlan(computed, placed, np.arange(100, 100 + n, dtype=np.int64), np.full(n, 7, np.int64),
                   tuple(check_layers), tuple(keep))


def test_a_steps_plans_combine_into_its_layer0_rows_placed_kv_and_each_check_layers_segments():
    """Entries: a planned prefill of 6 rows (2 fixed, 4 placed and computed; keeps 3 then 1 placed at layers 1, 2),
    a plain prefill of 3 rows, a planned prefill of 4 rows (1 fixed, 3 placed of which 1 computed, no check
    layer), a decode. Plans of other features may differ in check layers: a plan without one is kept whole there."""
    plans = [plan([1, 1, 1, 1, 1, 1], [0, 1, 1, 0, 1, 1], (1, 2), (3, 1)), None,
             plan([1, 0, 1, 0], [0, 1, 1, 1])]
    n = np.array([6, 3, 4, 1], np.int64)
    slots = np.arange(14, dtype=np.int64) + 1000
    keep0, final_n, rows = step_rows(plans, n, slots, 3, [10, 11, 12, 13])
    assert keep0.tolist() == [True] * 9 + [True, False, True, False] + [True]
    assert final_n.tolist() == [2 + 1, 3, 2, 1]            # fixed + the last check layer's kept placed rows
    assert rows.src_slots.tolist() == [100, 101, 102, 103, 100, 101, 102]
    assert rows.dst_slots.tolist() == [1001, 1002, 1004, 1005, 1010, 1011, 1012]
    assert rows.deltas.tolist() == [7] * 7
    assert rows.placed.tolist() == [False, True, True, False, True, True] + [False] * 3 + [False, True] + [False]
    assert rows.first_rows == {10: 0, 12: 9}                 # layer-0 layout: 6 + 3 rows before the second plan
    (seg1, qsl1), (seg2, qsl2) = rows.checks[1], rows.checks[2]
    assert sorted(rows.checks) == [1, 2]
    assert seg1 == [(0, 6, 2 + 3), (6, 3 + 2 + 1, -1)]       # runs of whole segments become one
    assert qsl1.tolist() == [0, 5, 8, 10]
    assert seg2 == [(0, 5, 2 + 1), (5, 6, -1)]
    assert qsl2.tolist() == [0, 3, 6, 8]


def test_a_check_layer_keeps_unplaced_rows_and_the_most_deviating_placed_ones_ties_to_the_lower_row():
    deviation = torch.tensor([9.0, 1.0, 5.0, 5.0, 0.5, 3.0, 2.0, 8.0])
    placed = torch.tensor([False, True, True, True, True, False, True, True])
    check = RowSelection([(0, 5, 3), (5, 3, -1)], torch.zeros(3, dtype=torch.int32))
    # Segment 0: row 0 unplaced (kept whatever its deviation), then 2 of the placed rows 1..4: 2 and 3 tie at 5.0,
    # above 1.0 and 0.5. Segment 1 whole.
    assert select_rows(check, deviation, placed).tolist() == [0, 2, 3, 5, 6, 7]
    check = RowSelection([(0, 5, 2)], torch.zeros(2, dtype=torch.int32))
    # Rows 2 and 3 tie for one place: the lower row wins.
    assert select_rows(check, deviation, placed).tolist() == [0, 2]


def test_a_plan_whose_parts_disagree_is_refused_by_name():
    with pytest.raises(ValueError, match="computed .3. and placed .2."):
        RowPlan(np.ones(3, bool), np.ones(2, bool), np.zeros(2, np.int64), np.zeros(2, np.int64))
    with pytest.raises(ValueError, match="2 placed rows has 1 source slots and 2 deltas"):
        RowPlan(np.ones(3, bool), np.array([1, 1, 0], bool), np.zeros(1, np.int64), np.zeros(2, np.int64))
    with pytest.raises(ValueError, match=r"check layers \(1, 2\) and keep counts \(3,\)"):
        plan([1, 1, 1], [1, 1, 1], (1, 2), (3,))
    ok = plan([1, 1, 1], [0, 1, 1], (1,), (1,))   # the limit: as many keep counts as check layers
    assert ok.num_fixed == 1


def test_the_in_place_plan_places_each_row_on_itself_and_selects_nothing():
    rows = HostRows.in_place(5)
    assert rows.src_slots.tolist() == rows.dst_slots.tolist() == list(range(5))
    assert not rows.deltas.any() and not rows.placed.any() and rows.checks == {} and rows.first_rows == {}


def test_a_steps_grouped_plans_get_step_wide_groups_in_their_placed_rows():
    grouped = RowPlan(np.ones(5, bool), np.array([0, 1, 1, 1, 0], bool), np.zeros(3, np.int64),
                      np.zeros(3, np.int64), (1,), (2,), np.array([-1, 0, 0, 2, -1], np.int64))
    plans = [grouped, plan([1, 1, 1], [0, 1, 1], (1,), (1,)), grouped]
    _, final_n, rows = step_rows(plans, np.array([5, 3, 5], np.int64), np.arange(13, dtype=np.int64), 3, [1, 2, 3])
    assert rows.groups.tolist() == [-1, 0, 0, 2, -1] + [-1] * 3 + [-1, 3, 3, 5, -1]
    assert final_n.tolist() == [2 + 2, 1 + 1, 2 + 2]
    assert step_rows([plans[1]], np.array([3], np.int64), np.arange(3, dtype=np.int64), 1, [2])[2].groups is None
    with pytest.raises(ValueError, match="a group >= 0 where placed"):
        RowPlan(np.ones(2, bool), np.ones(2, bool), np.zeros(2, np.int64), np.zeros(2, np.int64), (1,), (1,),
                np.array([0, -1], np.int64))


@st.composite
def grouped_rows(draw):
    """(deviations, groups): groups of 1..8 rows in ascending order with ungrouped rows (-1) among them, integer
    deviations (so that the float32 quotients order exactly as their fractions)."""
    groups = []
    for g in range(draw(st.integers(1, 5))):
        groups += [g] * draw(st.integers(1, 8))
        groups += [-1] * draw(st.integers(0, 2))
    deviations = draw(st.lists(st.integers(0, 20), min_size=len(groups), max_size=len(groups)))
    return deviations, groups


# two groups, sums 16 and 4: 5 places go 4 and 1 (an even split would give 3 and 2)
@example(rows=([4, 4, 4, 4, 1, 1, 1, 1], [0, 0, 0, 0, 1, 1, 1, 1]), share=5 / 8)
@example(rows=([3, 0, 9, 1, 2, 7], [0, 0, -1, 1, 1, 1]), share=0.0)   # the budget's edges: no place
@example(rows=([3, 0, 9, 1, 2, 7], [0, 0, -1, 1, 1, 1]), share=1.0)   # every place
@example(rows=([5, 5, 0, 0, 2, 8, 1], [0, 0, 1, 1, -1, 2, 2]), share=0.5)   # a group with nothing moved gets none
@given(rows=grouped_rows(), share=st.floats(0, 1))
def test_grouped_selection_shares_the_places_in_proportion_to_each_groups_deviation(rows, share):
    deviations, groups = rows
    dev, grp = torch.tensor(deviations, dtype=torch.float32), torch.tensor(groups)
    placed = grp >= 0
    n = int(placed.sum())
    k = round(share * n)
    kept = set(select_rows(RowSelection([(0, len(groups), len(groups) - n + k)], torch.zeros(2, dtype=torch.int32)),
                           dev, placed, grp).tolist())
    assert {i for i, g in enumerate(groups) if g < 0} <= kept, "an ungrouped (fixed) row was dropped"
    assert sum(groups[i] >= 0 for i in kept) == k, "the places do not add up to the budget"
    held, sums, sizes = {}, {}, {}
    for g in set(groups) - {-1}:
        members = [i for i, x in enumerate(groups) if x == g]
        by_dev = sorted(members, key=lambda i: (-deviations[i], i))
        held[g] = sum(i in kept for i in members)
        assert set(by_dev[:held[g]]) <= kept, f"group {g} kept rows that deviate less than ones it dropped"
        sums[g], sizes[g] = sum(deviations[i] for i in members), len(members)
    # Sainte-Laguë: one divisor d gives each group round(S / d) places (capped at its rows): every place held is
    # worth at least every place not taken, S / (2 held - 1) >= S' / (2 held' + 1)
    last_held = min((Fraction(sums[g], 2 * held[g] - 1) for g in held if held[g]), default=None)
    next_free = max((Fraction(sums[g], 2 * held[g] + 1) for g in held if held[g] < sizes[g]), default=None)
    assert last_held is None or next_free is None or last_held >= next_free, (held, sums)
    # the fast engine's scores are the reference blend's, bit for bit
    assert torch.equal(group_scores(dev, grp)[placed], apportioned(dev[placed], grp[placed]))
    assert torch.equal(group_scores(dev, grp)[~placed], dev[~placed])
