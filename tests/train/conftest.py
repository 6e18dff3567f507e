"""One torch thread for the training tests: the CI machine's cores are shared, and small ops gain nothing."""
import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    torch.set_num_threads(1)
    yield
