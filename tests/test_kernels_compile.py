"""The attention kernels' GPU path compiles for Hopper (sm_90) and fits its shared memory, checked on any machine
(tests/hopper_compile.py, in its own process: the rest of the CPU suite runs the kernels through Triton's
interpreter, which compiles nothing)."""
import json
import os
import subprocess
import sys
from pathlib import Path


def test_attention_kernels_compile_for_hopper_and_fit_its_shared_memory():
    script = Path(__file__).with_name("hopper_compile.py")
    env = dict(os.environ, TRITON_INTERPRET="0")
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=900)
    # The script fails on a compile error or a kernel past Hopper's shared memory, naming it.
    assert proc.returncode == 0, f"compiling for sm_90 failed:\n{proc.stderr[-4000:]}"
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert {r["kernel"] for r in rows} == {"_paged_attention_kernel", "_split_kernel", "_shared_split_kernel"}
    # The launcher took its Hopper tiles (the interpreter's 128 rows would not prove them), with implicit positions
    # and with explicit ones; the split context's 128-row tiles, 4 key tiles a split; deterministic decodes' 64.
    assert [(r["BLOCK_M"], r["EXPLICIT_POSITIONS"], r["SPLIT_TILES"]) for r in rows
            if r["kernel"] == "_paged_attention_kernel"] == [(256, False, 0), (256, True, 0), (128, False, 4),
                                                             (64, False, 0)]
