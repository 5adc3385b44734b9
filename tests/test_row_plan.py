"""Row plans (chunkwise/engine/row_plan.py), the feature-neutral seam between the blend package that makes them and
the runner and model that apply them: a step's plans combine into the flat batch's layer-0 rows, placed K/V and
per-check-layer segments as each plan says; a check layer keeps every unplaced row and the placed rows that deviate
most; a malformed plan is refused by name. Host and CPU tensors only: no model runs here."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from chunkwise.engine.row_plan import HostRows, RowPlan, RowSelection, select_rows, step_rows

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
