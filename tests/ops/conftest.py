import pytest
import torch


def pytest_collection_modifyitems(config, items):
    """Leave out the parametrisations a test module marks as repeats of another (`same_as_default(path, n_tokens)`,
    test_moe_cuda.py's small_path pairs), which would otherwise be collected only to skip on every machine."""
    def repeat(item):
        same = getattr(item.module, "same_as_default", None)
        params = getattr(getattr(item, "callspec", None), "params", {})
        return same is not None and "small_path" in params and "n_tokens" in params and \
            same(params["small_path"], params["n_tokens"]) is not None
    items[:] = [item for item in items if not repeat(item)]


@pytest.fixture(autouse=True)
def _one_intra_op_thread():
    """Op tests run tiny tensors: intra-op threads only add synchronisation (about twice the CPU time on two
    cores, far more when the cores are shared)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def capture_graph():
    """capture(fn) -> (graph, out): fn runs once on a side stream (warm-up: builds, launch attributes), then is
    captured there; graph.replay() runs it again on the current stream."""
    def capture(fn):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out = fn()
        return graph, out
    return capture
