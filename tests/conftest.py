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


@pytest.fixture(scope="module")
def rules_revision_2():
    """The module's bundles are recorded under rounding-rule revision 2 (they replay under it, as any bundle
    replays under its own): its digits CNN log holds the first convolution's exact FP32 ties, about 2,000
    entries a step, many of which change the state when flipped or removed. Revision 3 leaves those out
    (exact in every order, tests/test_rounding.py), and a tampering or steering test needs entries that
    matter. Use it module-wide (``pytestmark = pytest.mark.usefixtures("rules_revision_2")``), so it is in
    force before the module's recordings."""
    from detrl.core import engine

    with pytest.MonkeyPatch.context() as m:
        m.setattr(engine, "RULES_REVISION", 2)
        yield
