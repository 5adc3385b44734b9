"""The invariance tier's verdict does not depend on the CPU: the bitwise properties hold under every x86 kernel
of OpenBLAS (numpy's BLAS), forced one at a time.

Under Triton's interpreter the attention kernels once took their tile products from numpy's matmul, and
OpenBLAS's Haswell kernel (picked on AMD EPYC hosts without AVX-512) rounds a row depending on its place in the
product, so a query row's bits changed with its chunk. OPENBLAS_CORETYPE is set only in each subprocess here.
"""
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.correctness,
              pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the kernels do not use the host BLAS")]

ROOT = Path(__file__).resolve().parent.parent
# OpenBLAS core type -> the /proc/cpuinfo flag its kernels need (forcing it without the flag is SIGILL).
# Haswell's kernel is the one that rounded by row position; SkylakeX's is what AVX-512 hosts pick. (SandyBridge's and
# Prescott's, older x86 kernels, passed too: dropped to keep CI within its 15 minutes.)
CORE_TYPES = {"Haswell": "avx2", "SkylakeX": "avx512f"}

# The pinned cases, then the chunking property with one example (ci draws 8; each interpreter run here must
# stay cheap). Split-KV decode is left out: its rows are the heads of one KV head, each always in the same row,
# so a BLAS that rounds by row position cannot change its bits.
SCRIPT = """
import torch
from hypothesis import HealthCheck, settings
settings.register_profile("openblas", max_examples=1, derandomize=True, deadline=None, database=None,
                          suppress_health_check=list(HealthCheck))
settings.load_profile("openblas")
from tests import test_kernels
cpu = torch.device("cpu")
for case in test_kernels.PINNED_ROW_CASES:
    test_kernels.check_rows_invariant(**case, device=cpu)
test_kernels.test_attention_rows_are_bitwise_invariant_to_chunking_page_size_permutation_and_batch(device=cpu)
print("bitwise invariance held")
"""


def _cpu_flags():
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].split() for line in f if line.startswith("flags"))
    except (OSError, StopIteration):
        return None


@pytest.mark.parametrize("core", list(CORE_TYPES))
def test_attention_bitwise_invariance_holds_under_every_openblas_x86_kernel(core):
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip(f"OpenBLAS's x86 kernels need an x86 CPU, not {platform.machine()}")
    flags = _cpu_flags()
    if flags is None:
        pytest.skip("no /proc/cpuinfo to tell which OpenBLAS kernels this CPU can run")
    if CORE_TYPES[core] not in flags:
        pytest.skip(f"this CPU lacks {CORE_TYPES[core]}, which OpenBLAS's {core} kernel needs")
    env = dict(os.environ, OPENBLAS_CORETYPE=core, OPENBLAS_VERBOSE="2", TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    run = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    output = run.stdout + run.stderr
    # OPENBLAS_VERBOSE=2 makes OpenBLAS name the core it loaded ("Core: Haswell"); a build without a kernel
    # of that name takes its nearest one (Prescott -> Katmai).
    loaded = next((line for line in output.splitlines() if line.startswith("Core:")), None)
    assert run.returncode == 0, f"OPENBLAS_CORETYPE={core} ({loaded}): exit {run.returncode}\n{output[-4000:]}"
    if loaded is None:
        pytest.skip("numpy's BLAS is not OpenBLAS (it named no core), so OPENBLAS_CORETYPE changed nothing")
    assert "bitwise invariance held" in run.stdout
