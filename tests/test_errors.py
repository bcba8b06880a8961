"""Bad input gets a clear error, and other requests' outputs are unchanged afterwards."""
import pytest
import torch

import dsv4rt
from dsv4rt import CapacityError, RequestError, UnknownRequest

CFG = dsv4rt.ModelConfig.tiny()


@pytest.fixture(scope="module")
def model():
    return dsv4rt.Model.random(CFG, seed=0)


def tokens(n, seed):
    return torch.randint(0, CFG.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def continue_other(rt, handle, seq):
    return torch.cat([rt.step({handle: [t]})[handle] for t in seq])


def clean_run(model, prefix, seq, **kw):
    rt = dsv4rt.Runtime(model, **kw)
    r = rt.admit()
    rt.step({r: prefix})
    return continue_other(rt, r, seq)


BAD_CALLS = {
    # name: (call(rt, victim_handle, other_handle), error type, message fragment)
    "context overflow": (lambda rt, v, o: rt.step({o: [3], v: list(range(1, 80))}), RequestError, "max_context"),
    "token id >= vocab": (lambda rt, v, o: rt.step({o: [3], v: [1, CFG.vocab_size]}), RequestError, "vocabulary"),
    "negative token id": (lambda rt, v, o: rt.step({v: [-1]}), RequestError, "vocabulary"),
    "unknown handle": (lambda rt, v, o: rt.step({o: [3], 12345: [1]}), UnknownRequest, "12345"),
    "released handle": (lambda rt, v, o: (rt.release(v), rt.step({o: [3], v: [1]})), UnknownRequest, "released"),
    "double release": (lambda rt, v, o: (rt.release(v), rt.release(v)), UnknownRequest, "released"),
    "empty tokens": (lambda rt, v, o: rt.step({o: [3], v: []}), RequestError, "no new tokens"),
    "too many admits": (lambda rt, v, o: rt.admit(), CapacityError, "max_requests"),
    "allocator exhausted": (lambda rt, v, o: rt.step({o: [3], v: list(range(1, 60))}), CapacityError, "exhausted"),
}


@pytest.mark.parametrize("name", list(BAD_CALLS))
def test_refusal_leaves_other_requests_intact(model, name):
    call, exc, fragment = BAD_CALLS[name]
    # 3 slots, 64-token contexts, one block: `other` holds it, so the victim's first entries cannot be stored
    kw = dict(max_requests=3, max_context=64, num_blocks=1)
    other_prefix, other_tail = tokens(20, 1), tokens(12, 2)
    rt = dsv4rt.Runtime(model, **kw)
    other, victim = rt.admit(), rt.admit()
    rt.admit()  # third slot taken: a further admit must fail
    rt.step({other: other_prefix, victim: tokens(3, 3)})  # 3 tokens: no entry closed, no block
    with pytest.raises(exc, match=fragment):
        call(rt, victim, other)
    got = continue_other(rt, other, other_tail)
    want = clean_run(model, other_prefix, other_tail, **kw)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_state_dict_errors(model):
    sd = {("model." + k if k != "lm_head.weight" else k): v for k, v in model.state_dict().items()}
    missing = dict(sd)
    del missing["model.layers.1.self_attn.compressor.indexer.q_b_proj.weight"]
    with pytest.raises(ValueError, match="missing tensor.*indexer.q_b_proj"):
        dsv4rt.Model.from_hf_state_dict(CFG, missing)
    extra = dict(sd, **{"model.layers.0.self_attn.bogus": torch.zeros(1)})
    with pytest.raises(ValueError, match="unexpected tensor.*bogus"):
        dsv4rt.Model.from_hf_state_dict(CFG, extra)
    shaped = dict(sd, **{"model.norm.weight": torch.zeros(CFG.hidden_size + 1)})
    with pytest.raises(ValueError, match=r"mis-shaped.*norm.weight.*expected \(128,\)"):
        dsv4rt.Model.from_hf_state_dict(CFG, shaped)
    # the good one still loads, and mtp.* / rotary buffers are ignored
    ok = dict(sd, **{"mtp.0.x": torch.zeros(1), "model.rotary_emb.main_inv_freq": torch.zeros(1)})
    assert dsv4rt.Model.from_hf_state_dict(CFG, ok) is not None


@pytest.mark.parametrize("field,value,fragment", [
    ("rope_dim", 256, "rope_dim"),
    ("o_groups", 3, "o_groups"),
    ("layer_types", ("sliding", "csa", "hca", "csa", "bogus"), "layer_types"),
    ("layer_types", ("sliding", "csa"), "layer_types"),
    ("mlp_types", ("hash",) * 4, "mlp_types"),
    ("hca_ratio", 48, "hca_ratio"),
    ("hidden_size", 0, "hidden_size"),
])
def test_invalid_config_names_the_field(field, value, fragment):
    with pytest.raises(ValueError, match=fragment):
        CFG.replace(**{field: value})


def test_runtime_argument_errors(model):
    with pytest.raises(ValueError, match="kv_dtype"):
        dsv4rt.Runtime(model, kv_dtype="int4")
    with pytest.raises(ValueError, match="max_requests"):
        dsv4rt.Runtime(model, max_requests=0)
    with pytest.raises(ValueError, match="fp8 KV layout"):
        dsv4rt.Runtime(dsv4rt.Model.random(CFG.replace(head_dim=96, rope_dim=64)), kv_dtype="fp8")


def test_native_kernels_mode_names_the_step_ops_without_a_kernel(monkeypatch):
    """kernels="native" refuses to start when an op the step calls has no CUDA kernel and names it; the
    standalone row codecs (not called by the step) do not count."""
    from dsv4rt import ops
    from dsv4rt.runtime import _load_kernels

    coverage = {op: "native" for op in ops.OPS}
    coverage.update(hc_pre="reference", kv_fp8_quantize="reference")
    monkeypatch.setattr(ops, "load_cuda_kernels", lambda: [])
    monkeypatch.setattr(ops, "kernel_coverage", lambda: dict(coverage))
    with pytest.raises(RuntimeError, match="hc_pre") as err:
        _load_kernels("native", True, print)
    assert "kv_fp8_quantize" not in str(err.value)
    coverage["hc_pre"] = "native"
    assert _load_kernels("native", True, print)["kv_fp8_quantize"] == "reference"
