import pytest

from graphtime import measure_copy_bandwidth, measure_matmul_rate


@pytest.fixture(scope="module")
def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth (bytes read + written per second), measured in this run."""
    return measure_copy_bandwidth()


@pytest.fixture(scope="module")
def matmul_rate() -> float:
    """bf16 matmul rate (FLOP per second), measured in this run."""
    return measure_matmul_rate()
