"""The attention kernels' and the deterministic matmul's GPU path compiles for Hopper (sm_90) and fits its shared
memory, checked on any machine
(tests/hopper_compile.py, in its own process: the rest of the CPU suite runs the kernels through Triton's
interpreter, which compiles nothing)."""
import json
import os
import subprocess
import sys
from pathlib import Path

HOPPER_SHARED_MEMORY = 228 * 1024   # an H100/H200 SM's, of which a block may take 227 KB


def test_attention_kernels_and_matmul_compile_for_hopper_and_fit_its_shared_memory():
    script = Path(__file__).with_name("hopper_compile.py")
    env = dict(os.environ, TRITON_INTERPRET="0")
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=900)
    # The script fails on a compile error or a kernel past Hopper's shared memory, naming it.
    assert proc.returncode == 0, f"compiling for sm_90 failed:\n{proc.stderr[-4000:]}"
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert {r["kernel"] for r in rows} == {"_paged_attention_kernel", "_split_kernel", "_shared_split_kernel",
                                           "_matmul_kernel"}
    # The launcher took its Hopper tiles (the interpreter's two stages would not prove them): 256 rows; a blend's
    # 128 at explicit positions, 16 key tiles a split, and the split context's, 4 a split, both on three stages; 256
    # with row sums by dot; one-token decodes' 64, one program a sequence, on three stages, with row sums by dot on
    # 16 (deterministic mode's) and, in a busy batch, 64 rows on one stage.
    assert [(r["BLOCK_M"], r["EXPLICIT_POSITIONS"], r["SPLIT_TILES"], r["ONE_TOKEN"], r["SUM_BY_DOT"],
             r["num_stages"]) for r in rows if r["kernel"] == "_paged_attention_kernel"] == [
        (256, False, 0, False, False, 2), (128, True, 16, False, False, 3), (128, False, 4, False, False, 3),
        (256, False, 0, False, True, 2), (64, False, 0, True, False, 3), (16, False, 0, True, True, 3),
        (64, False, 0, True, False, 1)]
    # Two blocks an SM where the batch is busy: the point of its one stage.
    busy = [r for r in rows if r["kernel"] == "_paged_attention_kernel" and r["num_stages"] == 1]
    assert 2 * busy[0]["shared"] <= HOPPER_SHARED_MEMORY, busy
    # The matmul's decode tile and both wide ones (the interpreter's would not prove them).
    assert [(r["BLOCK_M"], r["BLOCK_N"], r["BLOCK_K"], r["num_warps"], r["num_stages"]) for r in rows
            if r["kernel"] == "_matmul_kernel"] == [(64, 64, 64, 4, 4), (128, 128, 64, 8, 3), (128, 256, 64, 8, 3)]
