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
"""
from __future__ import annotations

import functools
import inspect


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
    return True
