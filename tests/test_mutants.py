"""The mutation catalogue (scripts/mutants.py): every catalogued bug still applies to this tree, and the CI
selection kills each one. The first test is cheap and runs in CI; the kill run takes about half an hour
on 2 cores (`slow`, weekly)."""
import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parent.parent / "scripts" / "mutants.py"
_spec = importlib.util.spec_from_file_location("mutants", _PATH)
mutants = importlib.util.module_from_spec(_spec)
sys.modules["mutants"] = mutants     # dataclasses look their module up by name
_spec.loader.exec_module(mutants)


def test_every_mutant_applies_to_the_tree_exactly_once():
    assert mutants.validate(mutants.MUTANTS) == []
    assert len(mutants.MUTANTS) >= 25


@pytest.mark.slow
@pytest.mark.parametrize("name", [m.name for m in mutants.MUTANTS])
def test_the_ci_selection_kills_the_mutant(name):
    result = mutants.run_one(next(m for m in mutants.MUTANTS if m.name == name))
    assert result.verdict == "killed", f"{name} ({result.mutant.bug}): {result.verdict}\n{result.tail}"


def test_every_smoke_entry_names_a_test_that_exists():
    """conftest.py's SMOKE orders the first tier by node id: a renamed test would silently leave it."""
    root = _PATH.parent.parent
    spec = importlib.util.spec_from_file_location("root_conftest", root / "conftest.py")
    conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conftest)
    for entry in conftest.SMOKE:
        path, _, name = entry.partition("::")
        assert (root / path).is_file(), entry
        assert not name or f"def {name}(" in (root / path).read_text(), f"{entry}: no such test"
