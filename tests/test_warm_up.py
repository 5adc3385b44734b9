"""The runner's construction warm-up: one step per Triton specialisation class that a real step can reach, so no
kernel compiles inside a user's (or a benchmark's timed) step. Pure checks of the step lists, no model run."""
from types import SimpleNamespace as NS

import pytest

from chunkwise.engine.model import PLANNED_SPLIT_ROWS, PREFILL_SPLIT_ROWS
from chunkwise.engine.model_runner import ModelRunner


def seq_class(n: int) -> str:
    """Triton's specialisation of an integer argument: 1, a multiple of 16, or neither."""
    return "one" if n == 1 else "x16" if n % 16 == 0 else "other"


def reachable_classes(split_rows: int, budget: int, longest: int) -> set[str]:
    """Classes of a real step's prefill sequences with more than split_rows rows: n sequences of 1..longest rows,
    at most budget rows in all."""
    return {seq_class(n) for n in range(1, budget + 1) if max(n, split_rows + 1) <= min(budget, n * longest)}


@pytest.mark.parametrize("budget, max_model_len", [
    (8192, 2064), (512, 4096), (513, 513), (1025, 1025), (1024, 4096), (8192, 32), (600, 20), (2000, 1), (1100, 64),
    (8192, 16)])
def test_the_warm_up_reaches_every_sequence_class_of_the_one_pass_prefill_attention(budget, max_model_len):
    """Prefills above PREFILL_SPLIT_ROWS (PLANNED_SPLIT_ROWS for a row plan) take the one-pass attention launch,
    which specialises on the count of prefill sequences: the warm-up has a step of each class a real step can
    reach, within the step budget and no sequence longer than max_model_len."""
    runner = NS(engine_config=NS(max_model_len=max_model_len, max_num_batched_tokens=budget))
    prefills = ModelRunner._one_pass_prefills(runner)
    assert all(sum(chunks) <= budget and all(1 <= n <= max_model_len for n in chunks) for chunks in prefills), \
        prefills
    for split_rows in (PREFILL_SPLIT_ROWS, PLANNED_SPLIT_ROWS):
        got = {seq_class(len(chunks)) for chunks in prefills if sum(chunks) > split_rows}
        assert got == reachable_classes(split_rows, budget, max_model_len), (split_rows, prefills)
