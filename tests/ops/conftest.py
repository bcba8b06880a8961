import pytest
import torch


@pytest.fixture(autouse=True)
def _one_intra_op_thread():
    """Op tests run tiny tensors: intra-op threads only add synchronisation (about twice the CPU time on two
    cores, far more when the cores are shared)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
