import shutil
from pathlib import Path

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    # Small models run fastest at one thread, and CI has two busy cores.
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture
def bundle(honest: Path, tmp_path: Path) -> Path:
    """A copy of the module's ``honest`` bundle (a module-scoped fixture each test module records), for
    one test to damage."""
    dst = tmp_path / "run"
    shutil.copytree(honest, dst)
    return dst
