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
