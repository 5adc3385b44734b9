"""Shared pytest set-up: the device, Triton's interpreter on CPU, Hypothesis profiles, the `gpu` marker."""
import os

import torch

# Triton reads TRITON_INTERPRET when it is first imported, so this must run before anything imports it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

_common = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
# ci: derandomized and bounded so the suite fits CI's 2 cores; tests scale it with their own max_examples.
settings.register_profile("ci", derandomize=True, max_examples=10, print_blob=True, **_common)
settings.register_profile("dev", max_examples=25, **_common)
settings.register_profile("thorough", max_examples=300, **_common)
settings.load_profile(os.environ.get("CHUNKWISE_HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


@pytest.fixture(scope="session")
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
