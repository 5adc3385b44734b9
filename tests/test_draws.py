"""tests/draws.py's `costly`: under the ci profile a costly property runs its @examples alone; elsewhere it draws
max_examples beside them; one without @examples is refused by name."""
import pytest
from hypothesis import Phase, example, given, settings, strategies as st

from tests import draws


def counted(costly, profile: str, monkeypatch, max_examples: int) -> list:
    """The values a costly property with two @examples saw under `profile`, every phase asked for (so a profile
    that runs @examples alone, as scripts/mutants.py's pinned stage, cannot make the draws vanish)."""
    monkeypatch.setattr(draws, "PROFILE", profile)
    seen = []

    @costly(max_examples=max_examples, derandomize=True, database=None, phases=tuple(Phase))
    @example(x=-1)
    @given(x=st.integers(0, 10**6))
    @example(x=-2)
    def prop(x):
        seen.append(x)

    prop()
    return seen


def test_a_costly_property_runs_its_examples_alone_in_ci_and_draws_beside_them_elsewhere(monkeypatch):
    assert sorted(counted(draws.costly, "ci", monkeypatch, 5)) == [-2, -1]
    for profile in ("dev", "thorough"):
        seen = counted(draws.costly, profile, monkeypatch, 5)
        assert sorted(x for x in seen if x < 0) == [-2, -1]
        assert 1 <= len([x for x in seen if x >= 0]) <= 5, seen


def test_a_costly_property_without_examples_is_refused_naming_it():
    with pytest.raises(TypeError, match="prop_without_examples: a costly property needs @examples"):
        @draws.costly(max_examples=3)
        @given(x=st.integers())
        def prop_without_examples(x):
            pass


def test_the_profile_costly_reads_is_the_one_conftest_loaded():
    """The same draws and seed rule (scripts/mutants.py's pinned stage loads a child of `ci` narrowed to @examples)."""
    chosen, loaded = settings.get_profile(draws.PROFILE), settings.default
    assert (chosen.max_examples, chosen.derandomize) == (loaded.max_examples, loaded.derandomize), draws.PROFILE
