"""The checkpoint cache: a directory built once, by one process at a time, then shared read-only.

Used by the tiny checkpoint factory and the real checkpoints alike. Directories live under
$CHUNKWISE_CACHE (default ~/.cache/chunkwise) and may be shared between users, so everything in them is
made world-readable (0755 directories, files readable by all).
"""
from __future__ import annotations

import fcntl
import os
import shutil
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

MARKER = "COMPLETE"


def cache_root() -> Path:
    return Path(os.environ.get("CHUNKWISE_CACHE") or Path.home() / ".cache" / "chunkwise")


def cached_dir(target: Path, key: str, build: Callable[[Path], None]) -> Path:
    """`target`, built by `build(tmp_dir)` unless it already holds a marker reading `key`.

    One process builds at a time (a lock file beside `target`; a waiting process says so on stderr). The
    build goes to a temporary sibling that gets the marker last and is then renamed over any stale or
    half-written `target`. Temporary siblings left by a build that was killed (SIGTERM, SIGKILL, power
    loss: no `finally` ran) are swept by the next build, which holds the lock, so none of them is live.
    """
    if _complete(target, key):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _locked(target.parent / f".{target.name}.lock", target):
        if _complete(target, key):  # another process finished it while we waited
            return target
        for orphan in target.parent.glob(_tmp_prefix(target) + "*"):
            shutil.rmtree(orphan, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=_tmp_prefix(target)))
        try:
            build(tmp)
            (tmp / MARKER).write_text(key)
            _share(tmp)
            if target.exists():
                shutil.rmtree(target)
            os.replace(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _tmp_prefix(target: Path) -> str:
    return f".{target.name}.tmp"


def _complete(target: Path, key: str) -> bool:
    marker = target / MARKER
    return marker.is_file() and marker.read_text() == key


def _share(root: Path) -> None:
    """Directories 0755 (mkdtemp makes 0700) and files readable by all: writers such as safetensors'
    save_file create their files 0600 whatever the umask."""
    root.chmod(0o755)
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:
            os.chmod(os.path.join(dirpath, d), 0o755)
        for f in filenames:
            path = os.path.join(dirpath, f)
            os.chmod(path, os.stat(path).st_mode | 0o444)


@contextmanager
def _locked(path: Path, what: Path):
    with open(path, "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"chunkwise: waiting for another process to finish building {what} (lock {path})",
                  file=sys.stderr, flush=True)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
