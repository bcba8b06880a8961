"""torch.compile(fullgraph=True) of the whole step (decode and prefill chunk): zero graph breaks, same logits."""
import pytest
import torch
import torch._dynamo.utils

import dsv4rt

CFG = dsv4rt.ModelConfig.tiny()


def tokens(n, seed):
    return torch.randint(0, CFG.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def drive(rt):
    """Two requests: uneven prefill chunks, a mixed step, then decodes crossing CSA and HCA closes."""
    a, b = tokens(40, 1), tokens(30, 2)
    ra, rb = rt.admit(), rt.admit()
    outs = [rt.step({ra: a[:13]}, all_logits=True)[ra]]
    o = rt.step({ra: a[13:20], rb: b[:17]}, all_logits=True)
    outs += [o[ra], o[rb]]
    for i in range(12):
        o = rt.step({ra: [a[20 + i]], rb: [b[17 + i]]})
        outs += [o[ra], o[rb]]
    return torch.cat(outs)


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8"])
def test_compiled_step_matches_eager_without_graph_breaks(kv_dtype):
    model = dsv4rt.Model.random(CFG, seed=0)
    eager = drive(dsv4rt.Runtime(model, max_requests=2, max_context=128, kv_dtype=kv_dtype))
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = drive(dsv4rt.Runtime(model, max_requests=2, max_context=128, kv_dtype=kv_dtype, compile=True))
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 2  # decode and prefill buckets
    # Inductor fuses and reorders fp32 math (~1e-7 differences); with FP8/FP4 caches an occasional value lands
    # on the other side of a rounding boundary, so fp8 gets a looser bound (measured max 5e-4 of max |logit|).
    tol = 1e-5 if kv_dtype == "auto" else 2e-3
    torch.testing.assert_close(compiled, eager, rtol=0, atol=tol * float(eager.abs().max()))


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8"])
def test_aot_eager_writes_caches_in_place(kv_dtype):
    """The "aot_eager" backend runs each cache-writing op on the cache itself: no forward graph clones a graph input
    or copies into one (functionalization's clone + copy_ back, two copies of every cache a step), and the steps
    and caches equal the eager runtime's bit for bit."""
    from dsv4rt.graphs import backend as gb

    assert gb.resolve("aot_eager") is gb.aot_eager_inplace and gb.resolve("inductor") == "inductor"
    model = dsv4rt.Model.random(CFG, seed=0)
    eager_rt = dsv4rt.Runtime(model, max_requests=2, max_context=128, kv_dtype=kv_dtype)
    eager = drive(eager_rt)
    torch._dynamo.reset()
    reports = []
    rt = dsv4rt.Runtime(model, max_requests=2, max_context=128, kv_dtype=kv_dtype, compile=True,
                        backend=gb.make_backend(lambda gm: reports.append(gb.inplace_report(gm))))
    compiled = drive(rt)
    assert len(reports) >= 2  # decode and prefill buckets
    for rep in reports:
        assert rep == {"auto_functionalized": 0, "copy_to_input": 0, "clone_of_input": 0}, rep
    assert torch.equal(compiled, eager)
    for (name, got), (_, want) in zip(rt.cache.named_buffers(), eager_rt.cache.named_buffers()):
        assert torch.equal(got, want), name


def test_functional_trace_has_the_copies_the_backend_removes():
    """The check above can fail: the plain functional trace of the same step clones the caches and copies back."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    from dsv4rt.graphs import backend as gb

    reports = []

    def fw(gm, example_inputs):
        reports.append(gb.inplace_report(gm))
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    model = dsv4rt.Model.random(CFG, seed=0)
    rt = dsv4rt.Runtime(model, max_requests=2, max_context=128, compile=True,
                        backend=aot_autograd(fw_compiler=fw, keep_inference_input_mutations=True))
    r = rt.admit()
    rt.step({r: tokens(3, 1)})
    assert reports and reports[0]["auto_functionalized"] > 0 and reports[0]["copy_to_input"] > 0, reports
