"""Triton's CPU interpreter without its per-call patching cost.

The interpreter maps `triton.language` onto numpy by patching the module's attributes (`_patch_lang`) when a
kernel launches, and restores them when the launch ends. It also patches again on every call of a
`@triton.jit` helper inside the kernel (`dot`, `cast`, `attend_tiles`...), which walks every member of
`triton.language` with `inspect.getmembers` (about 3 ms a call) and changes nothing the launch had not
already patched. Profiled on a real-checkpoint prefill through the interpreter, that was over a third of
the time. `speed_up()` skips a helper call's patching while the running launch has already patched the same
modules (Triton's own helpers such as `tl.sum` patch `triton.language.core` once per launch); launches
themselves patch and restore as before. If this Triton has no such internals, nothing is
changed.

Two more of the interpreter's per-call costs are work it redoes: each launch's patch walks the language modules
with `inspect.getmembers` to find their builtins again and wraps each anew (the same ones every time: they are read
and wrapped once, before any launch has patched them), and every op rebuilds the table from Triton dtypes to numpy dtypes (`_get_np_dtype`,
whose answers are kept per dtype). Profiled on the parity property's engine steps, the two were about a tenth of
the time.

And every integer add, sub and mul computes an overflow check: Triton redoes it in int64, compares it with the type's
bounds and hands the result to `device_assert` (`sanitize_overflow`), which drops it unless the kernel is built with
`debug`, in the interpreter as in a compiled kernel. Computed for nothing, it was about a third of a launch's time
in the same profile; the interpreter now skips it, as a compiled kernel's code does.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
from types import SimpleNamespace


def speed_up() -> bool:
    """Install the skip once; returns whether this Triton's interpreter has the internals it needs."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    patch = getattr(interpreter, "_patch_lang", None)
    if patch is None or getattr(patch, "_chunkwise", False):
        return patch is not None
    if list(inspect.signature(patch).parameters) != ["fn"] or not all(
            hasattr(interpreter, name) for name in ("_LangPatchScope", "GridExecutor")):
        return False
    active: list[set] = []   # per running launch: the language modules patched during it
    run = interpreter.GridExecutor.__call__

    @functools.lru_cache(maxsize=None)   # jit functions live as long as their modules
    def langs(fn) -> frozenset:
        return frozenset(id(v) for v in fn.__globals__.values()
                         if inspect.ismodule(v) and v in (interpreter.tl, interpreter.tl.core))

    def launch(self, *args, **kwargs):
        active.append(set())
        try:
            return run(self, *args, **kwargs)   # patches, runs the grid, restores its own patch
        finally:
            active.pop()

    def patch_lang(fn):
        mods = langs(fn)
        if active and mods <= active[-1]:
            return interpreter._LangPatchScope()   # already patched in this launch: nothing to do
        scope = patch(fn)
        if active:   # the launch's own patch, or a helper's, which outlives its call (Triton never restores it)
            active[-1] |= mods
        return scope

    patch_lang._chunkwise = True
    interpreter._patch_lang = patch_lang
    interpreter.GridExecutor.__call__ = launch
    _keep_lookups(interpreter)
    _no_overflow_checks(interpreter)
    return True


def _no_overflow_checks(interpreter) -> None:
    """Integer add, sub and mul without the interpreter's overflow check (module docstring)."""
    builder = getattr(interpreter, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if getattr(options, "sanitize_overflow", False) and not getattr(options, "debug", True) \
            and dataclasses.is_dataclass(options):
        builder.options = dataclasses.replace(options, sanitize_overflow=False)


def _keep_lookups(interpreter) -> None:
    """Builtins' patches built once per language module, and numpy dtypes kept per Triton dtype (module
    docstring)."""
    patch_builtin, np_dtype = getattr(interpreter, "_patch_builtin", None), getattr(interpreter, "_get_np_dtype", None)
    if patch_builtin is None or np_dtype is None or not hasattr(interpreter, "_patch_attr"):
        return
    tl = interpreter.tl
    # Read now, before any launch patched them (a patched member is no longer a builtin); Triton's own _patch_attr
    # builds each wrapper, recorded here instead of set, then set by every launch's patch.
    pkgs = [tl, tl.core, tl.tensor, tl.math]
    if hasattr(tl.core, "tensor_descriptor_base"):
        pkgs.append(tl.core.tensor_descriptor_base)
    wrappers = {}
    for pkg in pkgs:
        kept = wrappers[pkg] = []
        recorder = SimpleNamespace(set_attr=lambda obj, name, value, kept=kept: kept.append((name, value)))
        for name, member in inspect.getmembers(pkg):
            if tl.core.is_builtin(member):
                interpreter._patch_attr(pkg, name, member, None, recorder)

    def kept_patch_builtin(pkg, builder, scope):
        kept = wrappers.get(pkg)
        if kept is None:
            return patch_builtin(pkg, builder, scope)
        for name, wrapper in kept:
            scope.set_attr(pkg, name, wrapper)

    dtypes = {}

    def kept_np_dtype(tt_dtype):
        try:
            return dtypes[tt_dtype]
        except KeyError:
            dtypes[tt_dtype] = found = np_dtype(tt_dtype)
            return found
        except TypeError:   # unhashable: not a dtype this table holds
            return np_dtype(tt_dtype)

    interpreter._patch_builtin = kept_patch_builtin
    interpreter._get_np_dtype = kept_np_dtype
