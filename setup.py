"""Builds the native dispatch route of verifiable precision (detrl/core/native_dispatch.cpp) at install time.

Everything else about the package is in pyproject.toml. The extension compiles against the torch already
installed in the environment being installed into (the README installs torch first), found on disk rather
than imported: pip builds in an isolated environment that must not pull a torch of its own (PyPI's default
build is a CUDA one). Where there is no such torch, or no C++ compiler, the extension is skipped and the
install still succeeds: detrl then builds it on first use (detrl/core/native.py), or runs the pure-Python
rounding mode, which gives the same bits.
"""

from __future__ import annotations

import re
import sysconfig
from pathlib import Path

from setuptools import Extension, setup


def _torch_dir() -> Path | None:
    """The installed torch package of the target environment, or None."""
    for key in ("purelib", "platlib"):
        candidate = Path(sysconfig.get_paths()[key]) / "torch"
        if (candidate / "include" / "torch" / "extension.h").is_file() and (candidate / "lib").is_dir():
            return candidate
    return None


def _native_dispatch() -> list[Extension]:
    torch_dir = _torch_dir()
    if torch_dir is None:
        return []
    found = re.search(r"__version__\s*=\s*'([^']+)'", (torch_dir / "version.py").read_text())
    version = found.group(1) if found else "unknown"
    include = torch_dir / "include"
    return [
        Extension(
            "detrl.core._native_dispatch",
            sources=["detrl/core/native_dispatch.cpp"],
            include_dirs=[str(include), str(include / "torch" / "csrc" / "api" / "include")],
            library_dirs=[str(torch_dir / "lib")],
            libraries=["c10", "torch_cpu", "torch", "torch_python"],
            define_macros=[
                ("TORCH_EXTENSION_NAME", "_native_dispatch"),
                ("TORCH_API_INCLUDE_EXTENSION_H", None),
                ("DETRL_BUILT_FOR_TORCH", f'"{version}"'),
            ],
            extra_compile_args=["-std=c++20", "-O3", "-fno-fast-math", "-ffp-contract=off", "-w"],
            language="c++",
            optional=True,
        )
    ]


setup(ext_modules=_native_dispatch())
