"""The Hypothesis profile the suite runs under (conftest.py loads it), and `costly`: the draws of a property whose
examples take seconds each (engines stepped through Triton's interpreter).

In the `ci` profile such a property runs its @examples alone. Those are what the mutation catalogue's kills run
(`scripts/mutants.py --pinned-only`), so no recorded kill depends on a draw; under 2 cores CI's 15 minutes do not
hold the draws too. Every other profile (`dev`, `thorough`) draws `max_examples` beside them."""
from hypothesis import Phase, settings

# The profile conftest.py loaded, which it did before any test module imports this one.
PROFILE = settings.get_current_profile_name()


def explicit_examples(test) -> list:
    """A @given test's @examples, whichever side of @given they were written."""
    inner = getattr(getattr(test, "hypothesis", None), "inner_test", None)
    return list(getattr(test, "hypothesis_explicit_examples", None) or getattr(inner, "hypothesis_explicit_examples",
                                                                              None) or [])


def costly(max_examples: int, **kwargs):
    """`settings(max_examples=max_examples, **kwargs)`, except in the `ci` profile: the @examples alone (whatever
    `phases` kwargs gives). The outermost decorator; refuses a property with no @example (the `ci` profile would run
    nothing of it)."""
    def apply(test):
        if not explicit_examples(test):
            raise TypeError(f"{test.__name__}: a costly property needs @examples (under the ci profile they are all "
                            "it runs)")
        if PROFILE == "ci":
            return settings(**{**kwargs, "phases": [Phase.explicit]})(test)
        return settings(max_examples=max_examples, **kwargs)(test)
    return apply
