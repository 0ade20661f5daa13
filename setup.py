"""Builds the C++ extensions that need torch's headers at install time: the native dispatch route of verifiable
precision (detrl/core/native_dispatch.cpp), the commitments' rehash of a state's steady tensors
(detrl/core/state_records.cpp) and the DQN's MLP action and update (agents/mlp_native.cpp).

Everything else about the package is in pyproject.toml. Each extension compiles against the torch already
installed in the environment being installed into (the README installs torch first), found on disk rather
than imported: pip builds in an isolated environment that must not pull a torch of its own (PyPI's default
build is a CUDA one). Where there is no such torch, or no C++ compiler, an extension is skipped and the
install still succeeds: detrl then builds it on first use (detrl/core/extensions.py), or takes its Python
path, which gives the same bits.
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


#: (module, source) of each extension.
EXTENSIONS = [
    ("detrl.core._native_dispatch", "detrl/core/native_dispatch.cpp"),
    ("detrl.core._state_records", "detrl/core/state_records.cpp"),
    ("agents._mlp_native", "agents/mlp_native.cpp"),
]


def _torch_extensions() -> list[Extension]:
    torch_dir = _torch_dir()
    if torch_dir is None:
        return []
    found = re.search(r"__version__\s*=\s*'([^']+)'", (torch_dir / "version.py").read_text())
    version = found.group(1) if found else "unknown"
    include = torch_dir / "include"
    return [
        Extension(
            module,
            sources=[source],
            include_dirs=[str(include), str(include / "torch" / "csrc" / "api" / "include")],
            library_dirs=[str(torch_dir / "lib")],
            libraries=["c10", "torch_cpu", "torch", "torch_python"],
            define_macros=[
                ("TORCH_EXTENSION_NAME", module.rpartition(".")[2]),
                ("TORCH_API_INCLUDE_EXTENSION_H", None),
                ("DETRL_BUILT_FOR_TORCH", f'"{version}"'),
            ],
            # The flags that could change bits are detrl/core/extensions.py's CFLAGS (setup.py cannot
            # import detrl): keep the two equal.
            extra_compile_args=["-std=c++20", "-O3", "-fno-fast-math", "-ffp-contract=off", "-w"],
            language="c++",
            optional=True,
        )
        for module, source in EXTENSIONS
    ]


setup(ext_modules=_torch_extensions())
