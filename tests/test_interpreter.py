"""chunkwise.kernels.interpreter: Triton's interpreter patches `triton.language` once per launch, not once per helper
call, and computes exactly what it computed before."""
from __future__ import annotations

import inspect

import pytest
import torch
import triton
import triton.language as tl

from chunkwise.kernels.tiling import INTERPRET, dot
from chunkwise.kernels.interpreter import _no_overflow_checks, speed_up

pytestmark = pytest.mark.skipif(not INTERPRET, reason="the interpreter runs only without CUDA")


@triton.jit
def _many_helper_calls_kernel(a_ptr, b_ptr, out_ptr, N: tl.constexpr, CALLS: tl.constexpr):
    # a [N, N], b [N, N], out [N, N], all float32 contiguous
    r = tl.arange(0, N)
    a = tl.load(a_ptr + r[:, None] * N + r[None, :])
    b = tl.load(b_ptr + r[:, None] * N + r[None, :])
    acc = tl.zeros([N, N], tl.float32)
    for _ in range(CALLS):
        acc += dot(a, b, "ieee") + tl.sum(a, 1)[:, None]
    tl.store(out_ptr + r[:, None] * N + r[None, :], acc)


@pytest.fixture
def real_patches(monkeypatch):
    """The list of functions Triton's own `_patch_lang` ran for, while the test runs."""
    from triton.runtime import interpreter

    assert speed_up() and interpreter._patch_lang._chunkwise
    wrapper = interpreter._patch_lang
    cells = {c.cell_contents.__name__: c for c in wrapper.__closure__
             if getattr(c.cell_contents, "__name__", None) == "_patch_lang"}
    cell = cells["_patch_lang"]
    original, calls = cell.cell_contents, []

    def counting(fn):
        calls.append(fn.__name__)
        return original(fn)
    monkeypatch.setattr(cell, "cell_contents", counting)
    return calls


@triton.jit
def _failing_kernel(a_ptr, N: tl.constexpr):
    # a [N, N] float32
    r = tl.arange(0, N)
    a = tl.load(a_ptr + r[:, None] * N + r[None, :])
    a = dot(a, a, "ieee")
    tl.static_assert(N < 0, "fails after a helper call")


def _run(calls: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    a, b = torch.randn(16, 16, generator=gen), torch.randn(16, 16, generator=gen)
    out = torch.full((16, 16), float("nan"))
    _many_helper_calls_kernel[(1,)](a, b, out, N=16, CALLS=calls)
    return out, (a @ b + a.sum(1, keepdim=True)) * calls


def test_a_launch_patches_the_language_once_per_module_not_once_per_helper_call(real_patches):
    out, expected = _run(20, torch.Generator().manual_seed(0))
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-4)
    # The launch itself, then at most one helper per module it had not patched (tl.sum's triton.language.core):
    # 40 helper calls (20 dot, 20 tl.sum) without the skip.
    assert real_patches[0] == "_many_helper_calls_kernel" and len(real_patches) <= 3, real_patches


def test_every_launch_patches_afresh_even_after_a_failed_one(real_patches):
    gen = torch.Generator().manual_seed(1)
    with pytest.raises(Exception, match="fails after a helper call"):
        _failing_kernel[(1,)](torch.randn(16, 16, generator=gen), N=16)
    first = len(real_patches)
    out, expected = _run(3, gen)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-4)
    assert real_patches[first] == "_many_helper_calls_kernel", real_patches


def test_results_are_bitwise_those_of_the_unpatched_interpreter(monkeypatch):
    from triton.runtime import interpreter

    speed_up()
    fast, _ = _run(5, torch.Generator().manual_seed(2))
    cell = next(c for c in interpreter._patch_lang.__closure__
                if getattr(c.cell_contents, "__name__", None) == "_patch_lang")
    monkeypatch.setattr(interpreter, "_patch_lang", cell.cell_contents)   # Triton's own, patching every call
    slow, _ = _run(5, torch.Generator().manual_seed(2))
    assert torch.equal(fast, slow)


def replaced_after_the_walk(pkg) -> set[str]:
    """Names Triton's launch patch sets again after its walk of the builtins (`_patch_lang_core`'s)."""
    from triton.runtime import interpreter

    if pkg not in (tl, tl.core):
        return set()
    scope = interpreter._LangPatchScope()
    try:
        interpreter._patch_lang_core(pkg, scope)
        return {name for obj, name, _ in scope._changes if obj is pkg}
    finally:
        scope.restore()


def test_a_launchs_patch_sets_the_builtins_tritons_walk_finds_and_dtypes_map_as_tritons_table():
    """The builtins read once, before any launch, cover what Triton's own walk of each module finds now, and each
    other name they patch holds a patch Triton left behind (a helper's, never restored) of the same builtin; the
    kept numpy dtypes are Triton's table's."""
    from triton.runtime import interpreter

    assert speed_up()
    _run(1, torch.Generator().manual_seed(3))   # launches and helpers have patched the modules since the read
    for pkg in (tl, tl.core, tl.tensor, tl.math):
        walked = {name for name, member in inspect.getmembers(pkg) if tl.core.is_builtin(member)}
        scope = interpreter._LangPatchScope()
        try:
            interpreter._patch_builtin(pkg, interpreter.interpreter_builder, scope)
            patched = {name: (before, getattr(pkg, name).__kwdefaults__["member"])
                       for obj, name, before in scope._changes if obj is pkg}
        finally:
            scope.restore()
        assert walked and walked <= patched.keys(), (pkg, sorted(walked - patched.keys()))
        for name, (before, member) in patched.items():
            assert (tl.core.is_builtin(before) or name in replaced_after_the_walk(pkg)
                    or before.__kwdefaults__["member"] is member), (pkg, name)
    original = next(c.cell_contents for c in interpreter._get_np_dtype.__closure__
                    if getattr(c.cell_contents, "__name__", None) == "_get_np_dtype")
    for dtype in (tl.float32, tl.bfloat16, tl.float16, tl.int1, tl.int32, tl.int64, tl.uint16,
                  tl.pointer_type(tl.float32)):
        assert interpreter._get_np_dtype(dtype) == original(dtype) == interpreter._get_np_dtype(dtype), dtype


@triton.jit
def _int32_arithmetic_kernel(a_ptr, b_ptr, out_ptr, N: tl.constexpr):
    # a, b: int32 [N]; out: int32 [3, N], its rows a + b, a - b, a * b
    r = tl.arange(0, N)
    a = tl.load(a_ptr + r)
    b = tl.load(b_ptr + r)
    tl.store(out_ptr + r, a + b)
    tl.store(out_ptr + N + r, a - b)
    tl.store(out_ptr + 2 * N + r, a * b)


def test_int32_arithmetic_computes_no_overflow_check_and_wraps_as_a_compiled_kernels_does(monkeypatch):
    """Triton checks each int32 add, sub and mul for overflow in int64 and hands the result to `device_assert`,
    which drops it unless the kernel is built with `debug`: the interpreter computes no such check at all, and the
    arithmetic wraps as on the GPU."""
    from triton.runtime import interpreter

    speed_up()
    asserts = []
    semantic = interpreter.interpreter_semantic
    check = semantic.device_assert
    monkeypatch.setattr(semantic, "device_assert", lambda *a, **kw: asserts.append(a) or check(*a, **kw))
    big = 2 ** 31 - 1
    a = torch.tensor([big, -big, 46341, 7, -3, 0, 1, -1], dtype=torch.int32)
    b = torch.tensor([1, 2, 46341, 5, 9, 0, big, big], dtype=torch.int32)
    out = torch.zeros(3, 8, dtype=torch.int32)
    _int32_arithmetic_kernel[(1,)](a, b, out, N=8)
    assert asserts == []
    wrapped = [((x + y) & 0xFFFFFFFF, (x - y) & 0xFFFFFFFF, (x * y) & 0xFFFFFFFF)
               for x, y in zip(a.tolist(), b.tolist())]
    expected = torch.tensor([[w[i] - 2 ** 32 if w[i] >= 2 ** 31 else w[i] for w in wrapped] for i in range(3)],
                            dtype=torch.int32)
    assert torch.equal(out, expected)


def test_the_overflow_checks_stay_where_the_interpreter_runs_with_debug():
    """With `debug` its asserts fire, so the checks are kept; without it they go."""
    from types import SimpleNamespace

    from triton.runtime.interpreter import InterpreterOptions

    for debug in (True, False):
        fake = SimpleNamespace(interpreter_builder=SimpleNamespace(options=InterpreterOptions(debug=debug)))
        _no_overflow_checks(fake)
        assert fake.interpreter_builder.options.sanitize_overflow is debug
