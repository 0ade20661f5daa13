import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    # Small models run fastest at one thread, and CI has two busy cores.
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
