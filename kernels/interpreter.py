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
    if list(inspect.signature(patch).parameters) != ["fn"] or not hasattr(interpreter, "_LangPatchScope"):
        return False
    active: list[frozenset] = []   # per running launch: the language modules its patch covers

    @functools.lru_cache(maxsize=None)   # jit functions live as long as their modules
    def langs(fn) -> frozenset:
        return frozenset(id(v) for v in fn.__globals__.values()
                         if inspect.ismodule(v) and v in (interpreter.tl, interpreter.tl.core))

    def patch_lang(fn):
        mods = langs(fn)
        caller = inspect.currentframe().f_back
        is_launch = caller is not None and caller.f_code.co_name == "__call__" and \
            isinstance(caller.f_locals.get("self"), interpreter.GridExecutor)
        if not is_launch and active and mods <= active[-1]:
            return interpreter._LangPatchScope()   # already patched by the running launch: nothing to do
        scope = patch(fn)
        if not is_launch and active:   # a helper's patch outlives its call (Triton never restores it)
            active[-1] |= mods
        if is_launch:
            active.append(mods)
            restore = scope.restore

            def restore_and_pop():
                active.pop()
                restore()
            scope.restore = restore_and_pop
        return scope

    patch_lang._chunkwise = True
    interpreter._patch_lang = patch_lang
    return True
