"""Bad input gets a clear error, and other requests' outputs are unchanged afterwards."""
import numpy as np
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
    "tokens as a set": (lambda rt, v, o: rt.step({o: [3], v: {1, 2}}), RequestError, "sequence of ints, got set"),
    "bool tensor token": (lambda rt, v, o: rt.step({o: [3], v: [torch.tensor(True)]}), RequestError,
                          "token id tensor\\(True\\) is not an int"),
    "decode unknown handle": (lambda rt, v, o: rt.decode([o, 12345], torch.tensor([3, 1])), UnknownRequest, "12345"),
    "decode handle twice": (lambda rt, v, o: rt.decode([o, o], torch.tensor([3, 3])), RequestError, "appears twice"),
    "decode id count": (lambda rt, v, o: rt.decode([o, v], torch.tensor([3])), RequestError, "2 handles, 1 ids"),
    "decode float ids": (lambda rt, v, o: rt.decode([o], torch.tensor([3.0])), RequestError, "1-D integer tensor"),
    "decode handle dict": (lambda rt, v, o: rt.decode({o: 3}, torch.tensor([3])), RequestError, "sequence of handles"),
    "decode exhausted": (lambda rt, v, o: rt.decode([o, v], torch.tensor([3, 1])), CapacityError, "exhausted"),
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
    loaded = dsv4rt.Model.from_hf_state_dict(CFG, ok).state_dict()
    assert loaded.keys() == model.state_dict().keys()
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in loaded.items())


def test_state_dict_values_are_checked(model):
    """Values that would make a wrong model without a word: two names for one tensor (the last had won), an FP8
    tensor without its scale (loaded 1024x too large), NaN or a value past the target dtype's range, a non-tensor."""
    sd = {("model." + k if k != "lm_head.weight" else k): v for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="model.norm.weight and norm.weight both fill norm.weight"):
        dsv4rt.Model.from_hf_state_dict(CFG, dict(sd, **{"norm.weight": torch.zeros(CFG.hidden_size)}))
    kv = "model.layers.1.self_attn.kv_proj.weight"
    with pytest.raises(ValueError, match=f"{kv} has dtype torch.float8_e4m3fn.*needs its block scale"):
        dsv4rt.Model.from_hf_state_dict(CFG, dict(sd, **{kv: sd[kv].to(torch.float8_e4m3fn)}))
    tid = next(k for k in sd if k.endswith("tid2eid"))
    with pytest.raises(ValueError, match=f"{tid} has dtype torch.float32, expected an integer dtype"):
        dsv4rt.Model.from_hf_state_dict(CFG, dict(sd, **{tid: sd[tid].float()}))
    nan = sd[kv].clone()
    nan[3, 4] = float("nan")
    with pytest.raises(ValueError, match=f"{kv} holds non-finite values"):
        dsv4rt.Model.from_hf_state_dict(CFG, dict(sd, **{kv: nan}))
    big = "model.embed_tokens.weight"  # finite in float32, inf in float16
    with pytest.raises(ValueError, match=f"{big} holds non-finite values in torch.float16"):
        dsv4rt.Model.from_hf_state_dict(CFG, dict(sd, **{big: sd[big] * 1e6}), dtype=torch.float16)
    with pytest.raises(TypeError, match=f"state dict entry {big} is a list"):
        dsv4rt.Model.from_hf_state_dict(CFG, dict(sd, **{big: sd[big].tolist()}))
    with pytest.raises(TypeError, match="state_dict must be a mapping"):
        dsv4rt.Model.from_hf_state_dict(CFG, list(sd.items()))


def test_model_targets_are_checked():
    """dtype and device are checked by type and by what they can hold, before anything is built or read: device=None
    had built a model on the meta device whose steps returned meta logits."""
    with pytest.raises(TypeError, match="dtype must be a torch.dtype .* got str 'float32'"):
        dsv4rt.Model.random(CFG, dtype="float32")
    for device, fragment in ((None, "device must be a torch.device"), ("meta", "'meta' holds no weights"),
                             ("nowhere", "device must be a torch.device")):
        with pytest.raises(ValueError, match=fragment):
            dsv4rt.Model.random(CFG, device=device)
        with pytest.raises(ValueError, match=fragment):  # before the folder is looked at
            dsv4rt.Model.from_pretrained("/nonexistent/checkpoint", device=device)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="'cuda': no CUDA device is available"):
            dsv4rt.Model.random(CFG, device="cuda")
    with pytest.raises(TypeError, match="cfg must be a dsv4rt.ModelConfig, got dict"):
        dsv4rt.Model.random({"vocab_size": 512})


def test_hash_table_outside_the_experts_is_refused_at_load(model):
    """A hash layer's tid2eid naming an expert outside [0, n_experts) is refused by the loader, naming the tensor:
    a step would otherwise fail halfway, after writing other requests' caches."""
    sd = {("model." + k if k != "lm_head.weight" else k): v.clone() for k, v in model.state_dict().items()}
    name = next(k for k in sd if k.endswith("tid2eid"))
    for bad in (CFG.n_experts, -1):
        sd[name][5, 0] = bad
        with pytest.raises(ValueError, match=rf"tid2eid: expert id {bad} outside \[0, n_experts={CFG.n_experts}\)"):
            dsv4rt.Model.from_hf_state_dict(CFG, sd)
    sd[name][5, 0] = CFG.n_experts - 1  # the last expert is in range
    loaded = dsv4rt.Model.from_hf_state_dict(CFG, sd).state_dict()
    assert int(loaded[name.removeprefix("model.")][5, 0]) == CFG.n_experts - 1


@pytest.mark.parametrize("field,value,fragment", [
    ("norm_eps", -1.0, "norm_eps"),
    ("rope_theta", 0.0, "rope_theta"),
    ("routed_scale", float("nan"), "routed_scale"),
    ("swiglu_limit", -1.0, "swiglu_limit"),
    ("hc_eps", 0.0, "hc_eps"),
    ("eos_token_id", 10**6, "eos_token_id"),
    ("bos_token_id", -3, "bos_token_id"),
    ("max_position", 0, "max_position"),
    ("vocab_size", True, "vocab_size"),
    ("yarn", dsv4rt.config.Yarn(factor=0.0), "yarn"),
    ("yarn", {"factor": 2.0}, "yarn"),
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
    with pytest.raises(ValueError, match="num_blocks must be >= 0, got -1"):
        dsv4rt.Runtime(model, num_blocks=-1)
    with pytest.raises(ValueError, match="max_tokens_per_step must be >= 1, got 0"):
        dsv4rt.Runtime(model, max_tokens_per_step=0)
    for kw, name in ((dict(max_context=100.0), "max_context"), (dict(max_requests=2.5), "max_requests"),
                     (dict(num_blocks=2.5), "num_blocks"), (dict(max_tokens_per_step=3.5), "max_tokens_per_step")):
        with pytest.raises(TypeError, match=f"{name} must be an int"):
            dsv4rt.Runtime(model, **kw)
    with pytest.raises(ValueError, match="dtype must be torch.float32, torch.bfloat16 or torch.float16"):
        dsv4rt.Model.random(CFG, dtype=torch.int64)
    with pytest.raises(ValueError, match="fp8 KV layout"):
        dsv4rt.Runtime(dsv4rt.Model.random(CFG.replace(head_dim=96, rope_dim=64)), kv_dtype="fp8")
    with pytest.raises(ValueError, match=r"backend='inductor' is used only with compile=True or graphs=True"):
        dsv4rt.Runtime(model, backend="inductor")  # a CPU model: no graphs, no compile
    with pytest.raises(ValueError, match="backend='aot_eager' is used only with"):
        dsv4rt.Runtime(model, backend="aot_eager", graphs=False)
    with pytest.raises(TypeError, match="backend must be a torch.compile backend name or callable, got int"):
        dsv4rt.Runtime(model, compile=True, backend=123)  # had failed at the first step, refusing its requests
    with pytest.raises(ValueError, match=r"max_tokens_per_step \(4097\) must be <= max_requests \* max_context"):
        dsv4rt.Runtime(model, max_requests=1, max_context=4096, max_tokens_per_step=4097)
    # the default tokens a call never breaks the rule it is checked by (8 requests of 4 tokens had been refused)
    assert dsv4rt.Runtime(model, max_requests=8, max_context=4).max_tokens == 8


def test_block_allocator_refuses_what_would_share_a_block():
    """The public BlockAllocator hands a block out once until it is freed: freeing a block that is not allocated
    (out of range, already free, listed twice) is refused before anything changes."""
    alloc = dsv4rt.BlockAllocator(4)
    got = alloc.allocate(3)
    for bad, fragment in (([got[0], got[0]], "not allocated"), ([got[0], 3], "block 3 is not allocated"),
                          ([4], "4 is not a block of this allocator"), ([-1], "-1 is not a block"),
                          ([True], "True is not a block"), ([1.0], "1.0 is not a block")):
        with pytest.raises(ValueError, match=fragment):
            alloc.free(bad)
        assert alloc.num_free == 1
    alloc.free(got[:1])
    with pytest.raises(ValueError, match=f"block {got[0]} is not allocated"):  # a double free
        alloc.free(got[:1])
    assert sorted(alloc.allocate(2)) == sorted([got[0], 3]) and alloc.num_free == 0
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="block count >= 0"):
            alloc.allocate(bad)
    with pytest.raises(ValueError, match="num_blocks must be an int >= 0"):
        dsv4rt.BlockAllocator(-2)
    alloc = dsv4rt.BlockAllocator(np.int64(3))  # any integer scalar type, as elsewhere in the API
    got = alloc.allocate(np.int64(2))
    alloc.free([np.int64(got[0])])
    assert alloc.num_free == 2 and type(alloc._free[-1]) is int


def test_cache_sizes_and_kernels_mode_are_checked(model):
    """KVCache (public) refuses sizes a runtime would refuse, naming them; Runtime(kernels="") is a bad mode, not
    the default."""
    for kw, fragment in ((dict(max_requests=0), "max_requests must be >= 1"),
                         (dict(max_context=1.5), "max_context must be an int"),
                         (dict(num_blocks=-1), "num_blocks must be >= 0")):
        args = dict(max_requests=2, max_context=64) | kw
        with pytest.raises((TypeError, ValueError), match=fragment):
            dsv4rt.KVCache(CFG, args.pop("max_requests"), args.pop("max_context"), **args)
    with pytest.raises(ValueError, match="kernels must be 'auto', 'native' or 'reference', got ''"):
        dsv4rt.Runtime(model, kernels="")
    rt = dsv4rt.Runtime(model, max_requests=3, max_context=64)
    a, b = rt.admit(), rt.admit()
    rt.step({a: tokens(10, 1), b: tokens(10, 2)})
    state = [buf.clone() for layer in rt.cache.layers for buf in layer.per_slot()]
    for slot, fragment in ((-3, "slot must be >= 0"), (4, r"slot must be <= max_requests \(3\)")):
        with pytest.raises(ValueError, match=fragment):  # -3 had zeroed slot 1: b's ring and compressor state
            rt.cache.reset_slot(slot)
    assert all(torch.equal(x, buf) for x, buf in zip(state, (b for l in rt.cache.layers for b in l.per_slot())))


def test_runtime_flags_and_log_are_checked(model):
    """compile / graphs take a bool (graphs also None: the device decides) and log a callable, refused at
    construction with the argument's name; greedy_tokens takes step()'s dict."""
    for kw, fragment in ((dict(compile="yes"), "compile must be a bool, got 'yes'"),
                         (dict(graphs=1), "graphs must be a bool or None, got 1"),
                         (dict(log=5), "log must be a callable")):
        with pytest.raises(TypeError, match=fragment):
            dsv4rt.Runtime(model, **kw)
    with pytest.raises(TypeError, match="greedy_tokens takes step\\(\\)'s"):
        dsv4rt.greedy_tokens([torch.zeros(1, 4)])


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


def test_missing_kernel_sources_are_named(monkeypatch, tmp_path):
    """Without csrc/ (a non-editable install copies the packages only) the kernel build names the missing folder
    and the fix, instead of loading nothing; a runtime with kernels="auto" logs that and runs the references,
    kernels="native" refuses to start."""
    from dsv4rt import ops
    from dsv4rt.runtime import _load_kernels

    monkeypatch.setattr(ops, "CSRC", tmp_path / "csrc")
    with pytest.raises(FileNotFoundError, match="no kernel sources at .*csrc.*pip install -e"):
        ops.load_cuda_kernels()
    logged = []
    coverage = _load_kernels("auto", True, logged.append)
    assert len(logged) == 1 and "no kernel sources" in logged[0] and "running the reference ops" in logged[0]
    assert set(coverage) == set(ops.OPS)
    with pytest.raises(RuntimeError, match="kernels='native': the CUDA extension failed to build or load: "
                                           "load_cuda_kernels: no kernel sources"):
        _load_kernels("native", True, print)


def test_generate_checks_everything_before_the_first_step(model):
    """generate() refuses what would fail later (prompt plus new tokens past max_context, bad prompts and sampling
    arguments) before any step, with the prompt's index, and leaves the runtime's requests as they were."""
    rt = dsv4rt.Runtime(model, max_requests=2, max_context=64)
    other = rt.admit()
    rt.step({other: tokens(5, 1)})
    bad = [
        (dict(prompts=[[1, 2], [1] * 60], max_new_tokens=10), "prompt 1: 60 tokens \\+ 10 new exceed max_context=64"),
        (dict(prompts=[1, 2, 3]), "prompt 0: token ids must be a sequence of ints"),
        (dict(prompts=[[1], []]), "prompt 1 is empty"),
        (dict(prompts=[[1, CFG.vocab_size]]), "prompt 0: token id 512 outside the vocabulary"),
        (dict(prompts=[[1]], temperature=float("nan")), "temperature must be finite, got nan"),
        (dict(prompts=[[1]], temperature=10**400), "temperature must be finite, got 1000"),
        (dict(prompts=[[1]], temperature="0.5"), "temperature must be a real number, got str"),
        (dict(prompts=[[1]], stop_at_eos=np.True_), "stop_at_eos must be a bool, got numpy.bool"),
        (dict(prompts={(1, 2)}), "prompts must be a list of token-id lists, got set"),
        (dict(prompts=[torch.tensor([1 + 0j])]), "prompt 0: token ids must be a 1-D integer tensor"),
        (dict(prompts=[[1, CFG.vocab_size]], max_new_tokens=0), "prompt 0: token id 512 outside the vocabulary"),
        (dict(prompts=[[1]], top_p=1.5), "top_p"),
        (dict(prompts=[[1]], max_new_tokens=2.0), "max_new_tokens must be an int"),
        (dict(prompts=[[1]], top_k=2.5), "top_k must be an int"),
    ]
    for kw, fragment in bad:
        with pytest.raises(RequestError, match=fragment):
            rt.generate(**kw)
        assert rt.live == [other] and rt.position(other) == 5
    # at the limit it runs: 60 prompt tokens + 5 new feed 64 positions
    assert len(rt.generate([[1] * 60], max_new_tokens=5)[0]) == 5
    # a tiny temperature samples (the largest logit at 0 before dividing: no inf - inf)
    assert len(rt.generate([[1, 2]], max_new_tokens=3, temperature=1e-40, seed=1)[0]) == 3
    assert rt.live == [other]


def test_generate_groups_by_free_slots_and_blocks(model):
    """A prompt's new tokens depend on the seed and its place in the list only: not on the requests a caller holds
    (which set the group sizes), for sampling too (a generator a prompt). Groups are sized by the free blocks as well
    as the free slots; a prompt that no group could hold is refused before the first step. A numpy temperature is a
    temperature (its == 0 had been a numpy bool that step() refused after the slots were taken)."""
    kw = dict(max_new_tokens=5, temperature=np.float64(0.8), top_k=50, seed=7)
    prompts = [tokens(6, 1), tokens(3, 2), tokens(9, 3)]
    rt = dsv4rt.Runtime(model, max_requests=3, max_context=64)
    together = rt.generate(prompts, **kw)
    held = rt.admit()
    assert rt.generate(prompts, **kw) == together  # groups of two, then one
    rt.release(held)
    assert rt.generate(prompts, **{**kw, "temperature": np.float64(0.0)}) == rt.generate(prompts, max_new_tokens=5)

    long = [tokens(120, 4 + i) for i in range(3)]  # each holds the pool's one block by its last token
    tight = dsv4rt.Runtime(model, max_requests=3, max_context=256, num_blocks=1)
    assert tight.generate(long, max_new_tokens=4) == [tight.generate([p], max_new_tokens=4)[0] for p in long]
    none = dsv4rt.Runtime(model, max_requests=1, max_context=256, num_blocks=0)
    with pytest.raises(CapacityError, match="prompt 1 needs 1 cache blocks by its last token; 0 of the 0 are free"):
        none.generate([[1], long[0]], max_new_tokens=2)
    assert none.live == [] and none._next_handle == 0  # refused before a slot was taken


def test_generate_uses_the_free_slots(model):
    """With some slots held by the caller, generate() runs its prompts in groups of the free slots; with none free
    it says so."""
    rt = dsv4rt.Runtime(model, max_requests=2, max_context=64)
    held = rt.admit()
    want = dsv4rt.Runtime(model, max_requests=2, max_context=64).generate([[1, 2], [3]], max_new_tokens=3)
    assert rt.generate([[1, 2], [3]], max_new_tokens=3) == want
    rt.admit()
    with pytest.raises(CapacityError, match="free request slot"):
        rt.generate([[1]], max_new_tokens=1)
    assert len(rt.live) == 2 and held in rt.live


def test_handles_and_contexts_take_integer_types(model):
    rt = dsv4rt.Runtime(model, max_requests=2, max_context=64)
    h = rt.admit()
    out = rt.step({torch.tensor(h): [1, 2]})  # any integer type names the handle
    assert list(out) == [h] and type(list(out)[0]) is int
    with pytest.raises(RequestError, match=f"request {h} appears twice"):
        rt.step({h: [3], torch.tensor(h): [4]})
    assert rt.position(h) == 2
    with pytest.raises(RequestError, match="context must be an int"):
        rt.admit_synthetic(5.5)
    with pytest.raises(RequestError, match="context must be an int"):
        rt.admit_synthetic(True)
    assert rt.live == [h]
    assert rt.position(torch.tensor(h)) == 2
    for one in (torch.tensor([h]), torch.tensor([[h]]), True):  # one element in a dimension is not a scalar handle
        with pytest.raises(UnknownRequest, match="unknown request handle"):
            rt.position(one)
        with pytest.raises(UnknownRequest, match="unknown request handle"):
            rt.step({one: [3]})
    with pytest.raises(RequestError, match=r"token id tensor\(\[3\]\) is not an int"):
        rt.step({h: [torch.tensor([3])]})
    assert rt.position(h) == 2
    free = rt.allocator.num_free
    rt.step({h: list(range(1, 31))})  # 32 positions: closed compressor entries hold blocks
    assert rt.allocator.num_free < free
    rt.release(torch.tensor(h))  # released whole: handle gone, slot and blocks free once
    assert rt.live == [] and rt.allocator.num_free == free
    with pytest.raises(UnknownRequest, match=f"unknown request handle {h}"):
        rt.release(h)
    a, b = rt.admit(), rt.admit()
    assert sorted([a, b]) == [h + 1, h + 2]  # both slots usable again, neither handed out twice
    with pytest.raises(CapacityError):
        rt.admit()


def test_generate_samples_at_any_positive_temperature(model):
    """A temperature below float32's smallest number is still a temperature (the sampling runs in float64; it used
    to divide 0 by 0 and fail halfway), and stop_at_eos takes a bool only (a truthy string was taken as True)."""
    rt = dsv4rt.Runtime(model, max_requests=2, max_context=64)
    greedy = rt.generate([[1, 2, 3]], max_new_tokens=3)
    assert rt.generate([[1, 2, 3]], max_new_tokens=3, temperature=1e-50, seed=5) == greedy
    with pytest.raises(RequestError, match="stop_at_eos must be a bool, got str"):
        rt.generate([[1, 2, 3]], max_new_tokens=3, stop_at_eos="no")
    assert rt.live == []


def test_seeds_are_checked_before_anything_is_taken(model, monkeypatch):
    """admit_synthetic and generate refuse a seed a generator cannot take before a slot or block is taken (a bad
    seed used to leave a half-admitted request holding both); a failure while admit_synthetic fills the caches
    gives the slot and blocks back."""
    rt = dsv4rt.Runtime(model, max_requests=2, max_context=64)
    other = rt.admit()
    free = rt.allocator.num_free
    for seed, fragment in (("x", "seed must be an int, got str"), (1.5, "seed must be an int"),
                           (True, "seed must be an int"), (1 << 64, "seed must be in \\[-2\\*\\*63, 2\\*\\*64\\)")):
        with pytest.raises(RequestError, match=fragment):
            rt.admit_synthetic(40, seed=seed)
        with pytest.raises(RequestError, match=fragment):
            rt.generate([[1, 2]], max_new_tokens=2, temperature=1.0, seed=seed)
        assert rt.live == [other] and rt.allocator.num_free == free
    assert rt.position(rt.admit_synthetic(40, seed=-1)) == 40  # any 64-bit seed, negative too
    rt.release(rt.live[-1])

    def fail(*args, **kwargs):
        raise RuntimeError("out of memory (simulated)")
    monkeypatch.setattr(dsv4rt.runtime, "store_rows", fail)
    with pytest.raises(RuntimeError, match="simulated"):
        rt.admit_synthetic(40)
    assert rt.live == [other] and rt.allocator.num_free == free
    h = rt.admit()  # the slot came back
    assert rt.live == [other, h]


def test_on_device_logits(model):
    """step(on_device=...) takes a bool only (refused before anything is written); on a CPU model the logits are
    the host ones, value for value."""
    rt, ref = (dsv4rt.Runtime(model, max_requests=2, max_context=64) for _ in range(2))
    h, g = rt.admit(), ref.admit()
    with pytest.raises(RequestError, match="on_device must be a bool"):
        rt.step({h: [1, 2]}, on_device="yes")
    with pytest.raises(RequestError, match="all_logits must be a bool, got str"):  # a truthy "no" was taken as True
        rt.step({h: [1, 2]}, all_logits="no")
    assert rt.position(h) == 0
    got = rt.step({h: [1, 2, 3]}, all_logits=True, on_device=True)[h]
    torch.testing.assert_close(got, ref.step({g: [1, 2, 3]}, all_logits=True)[g], rtol=0, atol=0)


def test_decode_takes_the_ids_where_they_are(model):
    """decode(handles, ids) equals step() on the same ids, bit for bit, split into several forward calls or not; an
    id outside the vocabulary runs clamped (the other requests' logits are those of a clamped id) and refuses its
    request once the host waits for the device, and a slot it had is clean for the next request."""
    kw = dict(max_requests=3, max_context=64, max_tokens_per_step=32)
    ref, rt = (dsv4rt.Runtime(model, **kw) for _ in range(2))
    split = dsv4rt.Runtime(model, **{**kw, "max_tokens_per_step": 3})  # three requests: one decode call each
    prompts = [tokens(9, 1), tokens(17, 2), tokens(4, 3)]
    hs = {name: [r.admit() for _ in prompts] for name, r in (("ref", ref), ("rt", rt), ("split", split))}
    for name, r in (("ref", ref), ("rt", rt), ("split", split)):
        r.step(dict(zip(hs[name], prompts)))
    ids = torch.tensor([5, 6, 7], dtype=torch.int32)
    for _ in range(6):
        want = ref.step({h: [t] for h, t in zip(hs["ref"], ids.tolist())})
        want = torch.cat([want[h] for h in hs["ref"]])
        torch.testing.assert_close(rt.decode(hs["rt"], ids), want, rtol=0, atol=0)
        got = split.decode(hs["split"][::-1], ids.flip(0))  # rows follow the handles' order
        torch.testing.assert_close(got.flip(0), want, rtol=1e-5, atol=1e-5)
        ids = want.argmax(-1)
    assert [rt.position(h) for h in hs["rt"]] == [len(p) + 6 for p in prompts]

    a, b, c = hs["rt"]
    bad = torch.tensor([ids[0], CFG.vocab_size, -3])
    got = rt.decode([a, b, c], bad)  # b's and c's ids are not read: they run clamped
    want = ref.step(dict(zip(hs["ref"], ([int(ids[0])], [CFG.vocab_size - 1], [0]))))
    torch.testing.assert_close(got, torch.cat([want[h] for h in hs["ref"]]), rtol=0, atol=0)
    rt.release(c)  # released before the host looked: its count goes with it
    d = rt.admit()  # c's slot
    with pytest.raises(RequestError, match=f"request {b}: decode\\(\\) was given a token id outside the vocabulary"):
        rt.step({b: [1]})  # host logits: the host waits, and looks, before this step
    assert rt.position(b) == len(prompts[1]) + 7  # six decodes and the bad one; this step did not run
    with pytest.raises(RequestError, match="outside the vocabulary"):
        rt.decode([a, b], torch.tensor([1, 1]))
    ids = ids[[0]]
    for _ in range(2):  # a and the slot's new request go on
        want = ref.step({hs["ref"][0]: [int(ids[0])]})[hs["ref"][0]]
        got = rt.decode([a, d], torch.cat([ids, ids]))
        torch.testing.assert_close(got[:1], want, rtol=1e-5, atol=1e-5)  # a batch of two against one
        ids = want.argmax(-1)
    assert rt.position(d) == 2
    rt.release(b)


def test_greedy_tokens_picks_each_requests_last_row(model):
    """greedy_tokens() takes the argmax of each request's last row (all_logits included), in the step's order, and
    generate() at temperature 0 continues with exactly those tokens."""
    rt = dsv4rt.Runtime(model, max_requests=2, max_context=64)
    a, b = rt.admit(), rt.admit()
    out = rt.step({b: [5], a: [1, 2, 3]}, all_logits=True)
    assert out[a].shape[0] == 3
    assert dsv4rt.greedy_tokens(out) == [int(out[b][-1].argmax()), int(out[a][-1].argmax())]
    first = dsv4rt.greedy_tokens({a: out[a]})
    want = dsv4rt.Runtime(model, max_requests=2, max_context=64).generate([[1, 2, 3]], max_new_tokens=2)[0]
    nxt = dsv4rt.greedy_tokens(rt.step({a: first}))
    assert first + nxt == want
    assert dsv4rt.greedy_tokens({}) == []
    for bad in ({0: torch.tensor([0.1, 0.9]), 1: torch.tensor([0.9, 0.1])}, {0: torch.empty(0, 5)}):
        with pytest.raises(TypeError, match="greedy_tokens takes step\\(\\)'s \\[rows >= 1, vocab\\] logits"):
            dsv4rt.greedy_tokens(bad)  # 1-D rows picked one token for all; an empty row picked none


def test_a_failed_forward_call_refuses_its_requests_and_spares_the_others(model):
    """An exception inside the forward (after validation) leaves its requests' caches possibly half written: those
    requests are refused from then on with a message that says so, while the others continue bit for bit and the
    broken one's slot can be released and reused."""
    kw = dict(max_requests=3, max_context=64)
    other_prefix, other_tail = tokens(20, 1), tokens(6, 2)
    rt = dsv4rt.Runtime(model, **kw)
    other, victim = rt.admit(), rt.admit()
    rt.step({other: other_prefix, victim: tokens(3, 3)})
    fn = rt._fn

    def failing(*args):
        raise RuntimeError("simulated device fault")

    rt._fn = failing
    with pytest.raises(RuntimeError, match="simulated device fault"):
        rt.step({victim: [5]})
    rt._fn = fn
    with pytest.raises(RequestError, match="forward call failed.*release it"):
        rt.step({other: [3], victim: [5]})
    assert rt.position(victim) == 3
    got = continue_other(rt, other, other_tail)
    torch.testing.assert_close(got, clean_run(model, other_prefix, other_tail, **kw), rtol=0, atol=0)
    rt.release(victim)
    fresh = rt.admit()
    assert rt.step({fresh: [1, 2]})[fresh].shape == (1, CFG.vocab_size)


@pytest.mark.parametrize("where", ["forward", "before_inputs_land"])
def test_a_step_split_into_calls_that_fails_refuses_what_it_advanced(model, where, monkeypatch):
    """A step longer than max_tokens_per_step runs as several forward calls. When a later call fails, the requests
    an earlier call advanced are refused from then on (their logits were lost: a retry of the step would feed their
    tokens twice), and so are the failing call's own once its inputs have landed; a request of the failing call
    whose inputs never landed keeps its position and continues; a request outside the step continues bit for bit."""
    kw = dict(max_requests=3, max_context=64, max_tokens_per_step=4)
    other_prefix, other_tail = tokens(5, 1), tokens(4, 2)
    rt = dsv4rt.Runtime(model, **kw)
    other, a, b = rt.admit(), rt.admit(), rt.admit()
    rt.step({other: other_prefix})
    calls = [0]
    if where == "forward":
        fn = rt._fn

        def flaky(*args):
            calls[0] += 1
            if calls[0] == 2:
                raise RuntimeError("simulated device fault")
            return fn(*args)
        rt._fn = flaky
    else:
        from dsv4rt.prepare import StepInputs
        real = StepInputs.copy_from

        def flaky(*args, **kwargs):
            calls[0] += 1
            if calls[0] == 2:
                raise RuntimeError("simulated device fault")
            return real(*args, **kwargs)
        monkeypatch.setattr(StepInputs, "copy_from", flaky)
    with pytest.raises(RuntimeError, match="simulated device fault"):
        rt.step({a: tokens(4, 3), b: tokens(4, 4)})  # two calls: a's 4 tokens, then b's
    if where == "forward":
        rt._fn = fn
    else:
        monkeypatch.undo()
    assert rt.position(a) == 4 and rt.position(b) == 0
    with pytest.raises(RequestError, match="request 1: its step failed \\(RuntimeError\\) after an earlier forward "
                                           "call had processed some of its tokens \\(position now 4.*release it"):
        rt.step({a: [1]})
    if where == "forward":
        with pytest.raises(RequestError, match="request 2: a forward call failed.*release it"):
            rt.step({b: [1]})
    else:
        assert rt.step({b: tokens(4, 4)})[b].shape == (1, CFG.vocab_size)  # nothing of b's was written
    got = continue_other(rt, other, other_tail)
    torch.testing.assert_close(got, clean_run(model, other_prefix, other_tail, **kw), rtol=0, atol=0)
    rt.release(a)
    assert rt.position(rt.admit()) == 0
