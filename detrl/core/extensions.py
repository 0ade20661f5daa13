"""Loading detrl's optional C++ extensions: the one built by ``pip install``, else a build on first use.

``setup.py`` compiles each extension against the torch installed in the target environment. A checkout
that was not installed that way, or a torch upgraded since, gets the extension built here once with
``torch.utils.cpp_extension`` (cached by torch under ``~/.cache/torch_extensions``). Where that fails too
(no C++ compiler, no ninja), or ``DETRL_BUILD_EXTENSIONS=0`` is set (a machine where a minute's build is
not worth it), the caller takes its Python path, which gives the same bits.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

#: The compile flags that could change a result's bits; ``setup.py`` passes the same.
CFLAGS = ["-O3", "-fno-fast-math", "-ffp-contract=off"]


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
    try:
        return cpp_extension.load(prebuilt.replace(".", "_"), [str(source)], extra_cflags=CFLAGS)
    except Exception as e:  # noqa: BLE001 - any build failure means: the Python path
        print(f"detrl: {purpose} did not build ({type(e).__name__}); using the Python path", file=sys.stderr)
        return None


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
