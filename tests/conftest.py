import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # tests/oracle.py, tests/factories.py


def pytest_collection_modifyitems(config, items):
    # a module's cpu_repeat(params) names parametrisations that only repeat another on the CPU: left out
    def repeat(item):
        hook = getattr(getattr(item, "module", None), "cpu_repeat", None)
        params = getattr(getattr(item, "callspec", None), "params", {})
        return hook is not None and hook(params)
    items[:] = [item for item in items if not repeat(item)]
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def _cuda_kernels():
    # DSV4RT_KERNELS=reference runs the CUDA tests on the reference ops only (no extension build)
    if torch.cuda.is_available() and os.environ.get("DSV4RT_KERNELS", "native") != "reference":
        import dsv4rt.ops
        dsv4rt.ops.load_cuda_kernels()


@pytest.fixture
def block_rows_copied(monkeypatch) -> list:
    """The `block_rows` argument of every StepInputs.copy_from call from here on (None: the whole block table),
    in call order; the copies still happen."""
    from dsv4rt.prepare import StepInputs

    calls: list = []
    real = StepInputs.copy_from

    def copy_from(self, host, block_rows=None):
        calls.append(block_rows)
        return real(self, host, block_rows)

    monkeypatch.setattr(StepInputs, "copy_from", copy_from)
    return calls
