"""Loading detrl's optional C++ extensions: the one built by ``pip install``, else a build on first use.

``setup.py`` compiles each extension against the torch installed in the target environment. A checkout
that was not installed that way, or a torch upgraded since, gets the extension built here once with
``torch.utils.cpp_extension`` (cached under torch's extension root, ``~/.cache/torch_extensions`` unless
``TORCH_EXTENSIONS_DIR`` says otherwise). Where that fails too (no C++ compiler, no ninja), or
``DETRL_BUILD_EXTENSIONS=0`` is set (a machine where a minute's build is not worth it), the caller takes
its Python path, which gives the same bits.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

#: The compile flags that could change a result's bits; ``setup.py`` passes the same.
CFLAGS = ["-O3", "-fno-fast-math", "-ffp-contract=off"]
#: A build lock older than this (seconds) was left by a build that was killed: a build takes about a minute.
STALE_LOCK_S = 600.0


def load(prebuilt: str, source: Path, purpose: str) -> ModuleType | None:
    """The extension module ``prebuilt`` (a dotted name, built by ``pip install``) if it was built for the
    running torch, else ``source`` built now (``purpose`` names it in the progress and failure lines), else
    None."""
    try:
        module = importlib.import_module(prebuilt)
        if getattr(module, "built_for_torch", None) == torch.__version__:
            return module
    except ImportError:
        pass
    if os.environ.get("DETRL_BUILD_EXTENSIONS", "1") == "0":
        return None
    from torch.utils import cpp_extension

    print(
        f"detrl: building {purpose} for torch {torch.__version__} (once; about a minute)",
        file=sys.stderr,
        flush=True,
    )
    name = prebuilt.replace(".", "_")
    try:
        build_dir = build_directory(name)
        clear_stale_lock(build_dir)
        return cpp_extension.load(name, [str(source)], extra_cflags=CFLAGS, build_directory=str(build_dir))
    except Exception as e:  # noqa: BLE001 - any build failure means: the Python path
        print(f"detrl: {purpose} did not build ({type(e).__name__}); using the Python path", file=sys.stderr)
        return None


def build_directory(name: str) -> Path:
    """Where extension ``name`` is built on first use (created): under torch's extension root, one folder per
    Python and torch version, so that an upgrade builds afresh beside the old build."""
    from torch.utils import cpp_extension

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    version = f"py{sys.version_info.major}{sys.version_info.minor}-torch{torch.__version__}"
    path = Path(root) / f"detrl-{version}" / name
    path.mkdir(parents=True, exist_ok=True)
    return path


def clear_stale_lock(build_dir: Path, now: float | None = None) -> bool:
    """Remove ``build_dir``'s build lock when it is older than :data:`STALE_LOCK_S`, saying so in one line;
    True when it did. Torch takes the lock for the length of a build and waits, without end, for a lock
    another process holds; a build killed midway (Ctrl-C on the first run) leaves its lock behind, and every
    later first-use build waited on it for good. A lock younger than that is a build in progress: kept."""
    lock = build_dir / "lock"
    try:
        age = (time.time() if now is None else now) - lock.stat().st_mtime
    except OSError:  # no lock: nothing to clear
        return False
    if age <= STALE_LOCK_S:
        return False
    lock.unlink(missing_ok=True)
    print(
        f"detrl: removed a build lock left {age / 60:.0f} minutes ago by a build that did not finish ({lock})",
        file=sys.stderr,
    )
    return True


@functools.cache
def _state_records() -> ModuleType | None:
    return load(
        "detrl.core._state_records", Path(__file__).with_name("state_records.cpp"), "the state records helper"
    )


def steady_records() -> type | None:
    """``SteadyRecords`` (detrl/core/state_records.cpp): the digest cache's check and rehash of a state's
    steady tensors in one call (:class:`detrl.formats.commit.DigestCache`), or None: the cache then takes
    its Python path, which gives the same records."""
    module = _state_records()
    return None if module is None else module.SteadyRecords


def same_listing() -> Callable[..., bool] | None:
    """``same_listing`` (detrl/core/state_records.cpp): the check of
    :class:`detrl.formats.commit.StateTensorCache` in one call, or None: the cache then checks in Python,
    with the same answer."""
    module = _state_records()
    return None if module is None else module.same_listing
