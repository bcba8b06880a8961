"""Reliability: random request lifecycles against isolated references, and refusals without side effects.

The lifecycle property drives one Runtime through random admit / step / release programs (prefill chunks and
decodes mixed across up to MAX_REQUESTS live requests, deliberate bad calls in between) and checks:
  * every accepted request's logits equal those of its whole token sequence run alone, as one prefill, on a
    fresh Runtime (chunking, batching, slot and block reuse must not change a request's numbers);
  * every refused call raises the documented error and leaves caches, step inputs, block tables, the
    allocator and every request byte-identical (hashed before and after);
  * after every accepted call, block tables, positions and the allocator agree with a host-side model.
The refusal tests then take each refusal in turn and continue the other requests next to a twin runtime
that never saw the bad call: outputs and final state must be bit-identical.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import os

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import dsv4rt
from dsv4rt.config import BLOCK_TOKENS
from dsv4rt.prepare import StepInputs
from oracle import rel_err

CFG = dsv4rt.ModelConfig.tiny()  # S, C, H, C, H; W=16, CSA rate 4, HCA rate 16, top-4 of 16 indexer heads
TOL = 1e-5  # max |dlogit| <= TOL * max |logit|, float32 (the bound)
MAX_REQUESTS = 6  # the "up to 6 concurrent requests"
MAX_CONTEXT = 160  # 40 CSA and 10 HCA windows, 10 ring wraps; a second cache block from 132 tokens on
# the minimum, derandomized: every run tries the same programs (DSV4RT_RELIABILITY_EXAMPLES for more)
EXAMPLES = int(os.environ.get("DSV4RT_RELIABILITY_EXAMPLES", "200"))
MIN_OPS, MAX_OPS = 10, 40  # drawn operations per program (hypothesis' lists average 20 for these bounds)
CHUNKS = (1, 2, 3, 4, 5, 7, 8, 13, 16, 17, 31, 32, 47, 64)  # new tokens per request per step; shrinks to 1
OVERFLOW = 8  # a context-overflow chunk asks for 1..OVERFLOW tokens past max_context
NUM_BLOCKS = (None, 3, 5)  # None: room for every slot at max_context (12); 3 and 5 run out mid-program
MAX_TOKENS_PER_STEP = (None, 16)  # None: 128; 16 splits long steps into several forward calls
BAD_TOKENS = (CFG.vocab_size, -1, 1 << 40)  # ids outside [0, vocab)
GHOST = 10**6  # a handle that is never admitted
REF_CACHE = 64  # isolated references kept (hit by repeated requests and while a failure shrinks)

# Op kinds a program draws from; the repeats are weights. "noop" first: a failing program shrinks by
# turning the operations it does not need into no-ops, which are left out of the printed program.
KINDS = ("noop",) + ("step",) * 5 + ("admit",) * 3 + ("release", "fault")
FAULTS = ("overflow", "bad_token", "empty_tokens", "empty_batch", "unknown", "released", "release_unknown",
          "release_released")
RATES = (CFG.csa_ratio, CFG.hca_ratio)


@functools.cache
def tiny_model() -> dsv4rt.Model:
    return dsv4rt.Model.random(CFG, seed=0)


@functools.cache
def stream(seed: int) -> tuple[int, ...]:
    """The token ids of a request admitted with this stream: request i's token at position p is stream[p]."""
    gen = torch.Generator().manual_seed(1000 + seed)
    return tuple(torch.randint(0, CFG.vocab_size, (MAX_CONTEXT + OVERFLOW,), generator=gen).tolist())


@functools.lru_cache(maxsize=REF_CACHE)
def alone(tokens: tuple[int, ...]) -> torch.Tensor:
    """fp32 logits [n, vocab] of `tokens` run alone, as one prefill in one forward call, on a fresh Runtime."""
    rt = dsv4rt.Runtime(tiny_model(), max_requests=1, max_context=MAX_CONTEXT, max_tokens_per_step=MAX_CONTEXT)
    h = rt.admit()
    return rt.step({h: list(tokens)}, all_logits=True)[h]


def blocks_needed(n_tokens: int) -> int:
    """Blocks a request holding n_tokens needs: one per BLOCK_TOKENS span in which some window has closed."""
    return max(math.ceil((n_tokens // m) * m / BLOCK_TOKENS) for m in RATES)


# ---------------------------------------------------------------------------------------------- state hashing
def digest(t: torch.Tensor) -> str:
    t = t.detach().cpu().contiguous()
    raw = t.reshape(-1).view(torch.uint8).numpy().tobytes()
    return f"{t.dtype}{tuple(t.shape)}:{hashlib.sha256(raw).hexdigest()}"


def runtime_tensors(rt: dsv4rt.Runtime) -> dict[str, torch.Tensor]:
    """Every tensor a call could write: the cache buffers, and the tensors the runtime holds directly, in step-input
    buffers or in lists of them (host block table, staging buffers, the static step inputs and their block table)."""
    out = {f"cache.{name}": b for name, b in rt.cache.named_buffers()}
    for name, value in vars(rt).items():
        items = enumerate(value) if isinstance(value, list) else [(None, value)]
        for i, item in items:
            key = name if i is None else f"{name}[{i}]"
            if isinstance(item, torch.Tensor):
                out[key] = item
            elif isinstance(item, StepInputs):
                out.update({f"{key}.{f.name}": getattr(item, f.name) for f in dataclasses.fields(item)})
    return out


def snapshot(rt: dsv4rt.Runtime) -> dict[str, object]:
    """Hashes of every runtime tensor, plus the allocator's free list, the requests, the free slots and the
    runtime's scalar attributes (next handle, staging index, ...)."""
    state: dict[str, object] = {name: digest(t) for name, t in runtime_tensors(rt).items()}
    state["allocator.free"] = tuple(rt.allocator._free)
    state["requests"] = tuple((h, r.slot, r.pos, tuple(r.blocks)) for h, r in rt._requests.items())
    state["free_slots"] = tuple(rt._free_slots)
    state.update({name: v for name, v in vars(rt).items() if isinstance(v, (bool, int, float, str))})
    return state


def assert_unchanged(before: dict, after: dict, what: str) -> None:
    changed = [k for k in before if before[k] != after[k]]
    assert not changed, f"{what} changed {changed}"


# ---------------------------------------------------------------------------------------------- programs
class Readable:
    """Falsifying examples are printed with hypothesis' pretty-printer: make it use the code-like __repr__."""

    def _repr_pretty_(self, p, cycle) -> None:
        p.text(repr(self))


@dataclasses.dataclass(frozen=True)
class Admit(Readable):
    label: str | None  # the request's name in the program; None when the admit is to be refused
    stream: int

    def __repr__(self) -> str:
        call = f"rt.admit()  # stream {self.stream}"
        return call if self.label is None else f"{self.label} = {call}"


@dataclasses.dataclass(frozen=True)
class Step(Readable):
    chunks: tuple[tuple[str, int], ...]  # (label, new tokens), in batch order
    last_only: bool = False  # all_logits=False
    bad_token: tuple[str, int] | None = None  # (label, id) replacing that request's last new token
    decode: bool = False  # one token a request, run by rt.decode(handles, ids) (last_only)

    def __repr__(self) -> str:
        body = ", ".join(f"{label}: {n}" for label, n in self.chunks)
        if self.decode:
            return f"rt.decode([{', '.join(label for label, _ in self.chunks)}], ids)"
        extra = ", last_only" if self.last_only else ""
        bad = f"  # {self.bad_token[0]}'s last token := {self.bad_token[1]}" if self.bad_token else ""
        return f"rt.step({{{body}}}{extra}){bad}"


@dataclasses.dataclass(frozen=True)
class Release(Readable):
    label: str

    def __repr__(self) -> str:
        return f"rt.release({self.label})"


@dataclasses.dataclass(frozen=True)
class Lifecycle(Readable):
    num_blocks: int | None
    max_tokens_per_step: int | None
    ops: tuple[Admit | Step | Release, ...]

    def __repr__(self) -> str:
        head = (f"rt = Runtime(model, max_requests={MAX_REQUESTS}, max_context={MAX_CONTEXT}, "
                f"num_blocks={self.num_blocks}, max_tokens_per_step={self.max_tokens_per_step})")
        return "\n".join(["", head, *map(repr, self.ops), ""])


class Spec:
    """What the runtime must do, tracked on the host: live requests, positions, blocks held, refusals."""

    def __init__(self, num_blocks: int | None) -> None:
        self.num_blocks = MAX_REQUESTS * math.ceil(MAX_CONTEXT / BLOCK_TOKENS) if num_blocks is None else num_blocks
        self.live: dict[str, int] = {}  # label -> tokens processed, in admission order
        self.streams: dict[str, int] = {}
        self.released: list[str] = []
        self.admitted = 0

    def room(self, label: str) -> int:
        return MAX_CONTEXT - self.live[label]

    def free_blocks(self) -> int:
        return self.num_blocks - sum(blocks_needed(p) for p in self.live.values())

    def refusal(self, op) -> tuple[type[Exception], ...]:
        """The errors `op` may raise; () if it must succeed."""
        if isinstance(op, Admit):
            return (dsv4rt.CapacityError,) if len(self.live) == MAX_REQUESTS else ()
        if isinstance(op, Release):
            return () if op.label in self.live else (dsv4rt.UnknownRequest,)
        if not op.chunks:
            return (dsv4rt.RequestError,)
        errors = set()
        for label, n in op.chunks:
            if label not in self.live:
                errors.add(dsv4rt.UnknownRequest)
            elif n == 0 or n > self.room(label) or (op.bad_token is not None and op.bad_token[0] == label):
                errors.add(dsv4rt.RequestError)
        if errors:
            return tuple(sorted(errors, key=lambda e: e.__name__))
        need = sum(blocks_needed(self.live[label] + n) - blocks_needed(self.live[label]) for label, n in op.chunks)
        return (dsv4rt.CapacityError,) if need > self.free_blocks() else ()

    def next_label(self) -> str:
        return f"r{self.admitted}"

    def apply(self, op) -> None:
        """Record an accepted op."""
        if isinstance(op, Admit):
            label = self.next_label()
            self.admitted += 1
            self.live[label], self.streams[label] = 0, op.stream
        elif isinstance(op, Release):
            del self.live[op.label]
            self.released.append(op.label)
        else:
            for label, n in op.chunks:
                self.live[label] += n


@dataclasses.dataclass(frozen=True)
class Choice:
    """One drawn operation before it meets the program's state; `to_op` makes it valid for that state.
    Drawn independently of the state, so a failing program shrinks by turning choices into no-ops."""
    kind: str
    picks: tuple[int, ...]  # which requests, as indices into the live (or releasable) ones
    sizes: tuple[int, ...]  # new tokens of each picked request
    last_only: bool
    decode: bool  # a step: one token for each picked request, through rt.decode
    stream: int  # token stream of an admitted request
    fault: str
    extra: int  # tokens past max_context of an overflow
    bad_token: int

    def to_op(self, spec: Spec) -> Admit | Step | Release | None:
        live = list(spec.live)
        roomy = [label for label in live if spec.room(label) > 0]

        def pick(labels: list[str], i: int) -> str:
            return labels[self.picks[i % len(self.picks)] % len(labels)]

        if self.kind == "noop":
            return None
        if self.kind == "fault":
            return self.to_fault(spec, live, roomy, pick)
        if self.kind == "step" and roomy:
            labels = list(dict.fromkeys(pick(roomy, i) for i in range(len(self.picks))))
            if self.decode:
                return Step(tuple((label, 1) for label in labels), last_only=True, decode=True)
            return Step(tuple((label, min(n, spec.room(label))) for label, n in zip(labels, self.sizes)),
                        self.last_only)
        if self.kind == "release" and live:
            return Release(pick(live, 0))
        # "admit", or a step / release with nothing to act on
        return Admit(None if len(live) == MAX_REQUESTS else spec.next_label(), self.stream)

    def to_fault(self, spec: Spec, live, roomy, pick) -> Step | Release:
        # a valid request goes first where there is one: the refusal must then come mid-batch
        first = ((pick(roomy, 1), 1),) if roomy else ()
        others = [label for label in live if label not in dict(first)]
        if self.fault == "overflow" and others:
            victim = pick(others, 0)
            return Step(first + ((victim, spec.room(victim) + self.extra),))
        if self.fault == "bad_token" and others and spec.room(pick(others, 0)) > 0:
            victim = pick(others, 0)
            return Step(first + ((victim, min(self.sizes[0], spec.room(victim))),), bad_token=(victim, self.bad_token))
        if self.fault == "empty_tokens" and others:
            return Step(first + ((pick(others, 0), 0),))
        if self.fault == "empty_batch":
            return Step(())
        if self.fault == "released" and spec.released:
            return Step(first + ((pick(spec.released, 0), 1),))
        if self.fault == "release_released" and spec.released:
            return Release(pick(spec.released, 0))
        if self.fault in ("release_unknown", "release_released"):
            return Release("ghost")
        return Step(first + (("ghost", 1),))


CHOICES = st.builds(
    Choice,
    kind=st.sampled_from(KINDS),
    picks=st.lists(st.integers(0, MAX_REQUESTS - 1), min_size=1, max_size=MAX_REQUESTS).map(tuple),
    sizes=st.lists(st.sampled_from(CHUNKS), min_size=MAX_REQUESTS, max_size=MAX_REQUESTS).map(tuple),
    last_only=st.booleans(),
    decode=st.booleans(),
    stream=st.integers(0, 2 * MAX_REQUESTS - 1),
    fault=st.sampled_from(FAULTS),
    extra=st.integers(1, OVERFLOW),
    bad_token=st.sampled_from(BAD_TOKENS),
)


@st.composite
def lifecycles(draw) -> Lifecycle:
    num_blocks = draw(st.sampled_from(NUM_BLOCKS))
    max_tokens = draw(st.sampled_from(MAX_TOKENS_PER_STEP))
    spec, ops = Spec(num_blocks), []
    for choice in draw(st.lists(CHOICES, min_size=MIN_OPS, max_size=MAX_OPS)):
        op = choice.to_op(spec)
        if op is None:
            continue
        if not spec.refusal(op):
            spec.apply(op)
        ops.append(op)
    return Lifecycle(num_blocks, max_tokens, tuple(ops))


# ---------------------------------------------------------------------------------------------- running them
class Driver:
    """Runs a program on a Runtime, checking each call against the Spec and recording every logit row."""

    def __init__(self, rt: dsv4rt.Runtime, num_blocks: int | None) -> None:
        self.rt, self.spec = rt, Spec(num_blocks)
        self.handles: dict[str, int] = {"ghost": GHOST}
        self.rows: dict[str, dict[int, torch.Tensor]] = {}  # label -> {position: fp32 logits [vocab]}
        self.seen: set[str] = set()  # features this program exercised (reported as hypothesis events)
        self.ever_held: dict[int, int] = {}  # block -> the first handle that held it
        self.used_slots: set[int] = set()

    def tokens(self, op: Step) -> dict[int, list[int]]:
        batch = {}
        for label, n in op.chunks:
            if label in self.spec.live:
                pos = self.spec.live[label]
                toks = list(stream(self.spec.streams[label])[pos:pos + n])
            else:
                toks = list(stream(0)[:n])
            if op.bad_token is not None and op.bad_token[0] == label:
                toks[-1] = op.bad_token[1]
            batch[self.handles[label]] = toks
        return batch

    def call(self, op):
        if isinstance(op, Admit):
            return self.rt.admit()
        if isinstance(op, Release):
            return self.rt.release(self.handles[op.label])
        batch = self.tokens(op)
        if op.decode:
            logits = self.rt.decode(list(batch), torch.tensor([t for toks in batch.values() for t in toks]))
            return {h: row[None] for h, row in zip(batch, logits)}
        return self.rt.step(batch, all_logits=not op.last_only)

    def run(self, op) -> None:
        expected = self.spec.refusal(op)
        if expected:
            before = snapshot(self.rt)
            try:
                self.call(op)
            except expected as e:
                self.seen.add(f"refused with {type(e).__name__}")
            else:
                raise AssertionError(f"{op!r} was accepted; expected {[e.__name__ for e in expected]}")
            assert_unchanged(before, snapshot(self.rt), f"refused {op!r}")
            return
        if isinstance(op, Release):
            self.check_against_alone(op.label)
        if isinstance(op, Step) and {n == 1 for _, n in op.chunks} == {True, False}:
            self.seen.add("decodes and prefill chunks in one step")
        if isinstance(op, Step) and op.decode:
            self.seen.add("decode() on a tensor of ids")
        out = self.call(op)
        if isinstance(op, Admit):
            assert op.label == self.spec.next_label()
            self.handles[op.label] = out
            self.rows[op.label] = {}
            if self.rt._requests[out].slot in self.used_slots:
                self.seen.add("admit into a released slot")
        elif isinstance(op, Step):
            assert sorted(out) == sorted(self.handles[label] for label, _ in op.chunks)
            for label, n in op.chunks:
                got = out[self.handles[label]]
                pos = self.spec.live[label]
                first = pos + n - 1 if op.last_only else pos
                assert got.dtype == torch.float32 and got.shape == (pos + n - first, CFG.vocab_size)
                self.rows[label].update(zip(range(first, pos + n), got))
        self.spec.apply(op)
        self.check_bookkeeping()

    def check_bookkeeping(self) -> None:
        rt, trash = self.rt, self.rt.cache.num_blocks
        live = {self.handles[label]: pos for label, pos in self.spec.live.items()}
        assert sorted(rt.live) == sorted(live)
        if len(live) == MAX_REQUESTS:
            self.seen.add(f"{MAX_REQUESTS} requests live at once")
        held, slots = [], []
        for h, pos in live.items():
            req = rt._requests[h]
            assert rt.position(h) == pos
            assert len(req.blocks) == blocks_needed(pos)
            row = rt.block_table[req.slot].tolist()
            assert row == req.blocks + [trash] * (len(row) - len(req.blocks)), f"block table of handle {h}"
            held += req.blocks
            for b in req.blocks:
                if self.ever_held.setdefault(b, h) != h:
                    self.seen.add("a released block reused by another request")
            slots.append(req.slot)
            self.used_slots.add(req.slot)
        assert sorted(held + rt.allocator._free) == list(range(rt.cache.num_blocks)), "a block leaked or is shared"
        assert sorted(slots + rt._free_slots) == list(range(MAX_REQUESTS)), "a request slot leaked or is shared"
        for slot in rt._free_slots:
            assert (rt.block_table[slot] == trash).all(), f"free slot {slot} still addresses blocks"

    def check_against_alone(self, label: str) -> None:
        rows = self.rows[label]
        n = self.spec.live[label]
        if not rows:
            return
        ref = alone(stream(self.spec.streams[label])[:n])
        positions = sorted(rows)
        got, want = torch.stack([rows[p] for p in positions]), ref[positions]
        err = rel_err(got, want)
        worst = positions[int((got - want).abs().amax(-1).argmax())]
        if n >= 3 * CFG.hca_ratio:
            self.seen.add("a request crossed >= 3 HCA windows")
        if blocks_needed(n) > 1:
            self.seen.add("a request held 2 blocks")
        assert err <= TOL, (f"{label} (stream {self.spec.streams[label]}, {n} tokens): rel err {err:.3g} against "
                            f"the request run alone, worst at position {worst}")


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None, print_blob=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(lifecycles())
def test_random_lifecycles_match_requests_run_alone(program):
    rt = dsv4rt.Runtime(tiny_model(), max_requests=MAX_REQUESTS, max_context=MAX_CONTEXT,
                        num_blocks=program.num_blocks, max_tokens_per_step=program.max_tokens_per_step)
    driver = Driver(rt, program.num_blocks)
    for op in program.ops:
        driver.run(op)
    for label in list(driver.spec.live):
        driver.check_against_alone(label)
    for feature in sorted(driver.seen):
        event(feature)


# ---------------------------------------------------------------------------------------------- single refusals
REFUSAL_NUM_BLOCKS = 3  # a, b and c take one block each; c's release leaves exactly one free


def populate(rt: dsv4rt.Runtime) -> dict[str, int]:
    """a: 101 tokens, b: 121 tokens (one block each); c: 9 tokens then released; d: 2 tokens (no block yet).
    All 3 slots are taken and one block is free."""
    h = {name: rt.admit() for name in "abc"}
    rt.step({h["a"]: list(stream(0)[:60]), h["b"]: list(stream(1)[:57]), h["c"]: list(stream(2)[:9])})
    rt.step({h["a"]: list(stream(0)[60:100]), h["b"]: list(stream(1)[57:120])})
    rt.step({h["a"]: [stream(0)[100]], h["b"]: [stream(1)[120]]})
    rt.release(h["c"])
    h["d"] = rt.admit()
    rt.step({h["d"]: list(stream(3)[:2])})
    return h


def carry_on(rt: dsv4rt.Runtime, h: dict[str, int]) -> list[dict[int, torch.Tensor]]:
    """Continue every request past the bad call (decodes, a chunk taking the last block, a release and a
    re-admit into the freed slot and block). Returns each step's outputs."""
    def toks(name, seed, n):
        pos = rt.position(h[name])
        return list(stream(seed)[pos:pos + n])
    outs = [rt.step({h["a"]: toks("a", 0, 1), h["b"]: toks("b", 1, 1), h["d"]: toks("d", 3, 1)}, all_logits=True)]
    outs.append(rt.step({h["b"]: toks("b", 1, 10)}, all_logits=True))  # to 132 tokens: the last free block
    rt.release(h["a"])
    h["e"] = rt.admit()
    outs.append(rt.step({h["e"]: toks("e", 4, 20), h["b"]: toks("b", 1, 1)}, all_logits=True))  # a's block
    for _ in range(3):  # d stays at 3 tokens: its 4th would close a window and need a block
        outs.append(rt.step({h["e"]: toks("e", 4, 1), h["b"]: toks("b", 1, 1)}))
    return outs


# (bad call, the error it must raise); h holds the handles of populate()
REFUSALS = [  # (call, error, what its message must say)
    pytest.param(lambda rt, h: rt.step({h["a"]: [5], h["b"]: [5] * (MAX_CONTEXT - 121 + 1)}), dsv4rt.RequestError,
                 r"request 1: 121 \+ 40 tokens exceeds max_context=160", id="context_overflow"),
    pytest.param(lambda rt, h: rt.step({h["a"]: [5], h["b"]: [5, CFG.vocab_size]}), dsv4rt.RequestError,
                 r"request 1: token id 512 outside the vocabulary \[0, 512\)", id="token_past_vocab"),
    pytest.param(lambda rt, h: rt.step({h["a"]: [5], h["b"]: [-1]}), dsv4rt.RequestError,
                 r"request 1: token id -1 outside the vocabulary", id="negative_token"),
    pytest.param(lambda rt, h: rt.step({h["a"]: [5], h["b"]: ["x"]}), dsv4rt.RequestError,
                 r"request 1: token id 'x' is not an int", id="non_int_token"),
    pytest.param(lambda rt, h: rt.step({h["a"]: [5], h["b"]: []}), dsv4rt.RequestError,
                 r"request 1: no new tokens", id="no_new_tokens"),
    pytest.param(lambda rt, h: rt.step({}), dsv4rt.RequestError, r"step\(\) takes a non-empty dict", id="empty_batch"),
    pytest.param(lambda rt, h: rt.step({h["a"]: [5], GHOST: [5]}), dsv4rt.UnknownRequest,
                 rf"unknown request handle {GHOST} ", id="unknown_handle"),
    pytest.param(lambda rt, h: rt.step({h["a"]: [5], h["c"]: [5]}), dsv4rt.UnknownRequest,
                 r"unknown request handle 2 ", id="released_handle"),
    pytest.param(lambda rt, h: rt.release(GHOST), dsv4rt.UnknownRequest, rf"unknown request handle {GHOST} ",
                 id="release_unknown"),
    pytest.param(lambda rt, h: rt.release([h["a"]]), dsv4rt.UnknownRequest, r"unknown request handle \[0\] ",
                 id="release_unhashable"),
    pytest.param(lambda rt, h: rt.release(h["c"]), dsv4rt.UnknownRequest, r"unknown request handle 2 ",
                 id="double_release"),
    pytest.param(lambda rt, h: rt.admit(), dsv4rt.CapacityError, r"all 3 request slots are in use",
                 id="too_many_requests"),
    # a (101 -> 135 tokens) would fit alone in the one free block; b (121 -> 135) then needs a second
    pytest.param(lambda rt, h: rt.step({h["a"]: list(stream(0)[101:135]), h["b"]: list(stream(1)[121:135])}),
                 dsv4rt.CapacityError, r"block allocator exhausted: the step needs 2 new blocks, 1 free",
                 id="allocator_exhausted_mid_batch"),
]


@pytest.mark.parametrize("bad_call, error, message", REFUSALS)
def test_refusal_leaves_no_trace(bad_call, error, message):
    def runtime():
        return dsv4rt.Runtime(tiny_model(), max_requests=3, max_context=MAX_CONTEXT, num_blocks=REFUSAL_NUM_BLOCKS)
    rt, twin = runtime(), runtime()  # twin never sees the bad call
    h, h_twin = populate(rt), populate(twin)
    assert rt.allocator.num_free == 1 and not rt._free_slots
    assert {"block_table", "inputs.block_table"} <= set(runtime_tensors(rt))  # both tables are hashed
    before = snapshot(rt)
    with pytest.raises(error, match=message):  # the message names the problem
        bad_call(rt, h)
    assert_unchanged(before, snapshot(rt), "the refused call")
    assert before == snapshot(twin)  # the twin is a fair comparison
    outs, outs_twin = carry_on(rt, h), carry_on(twin, h_twin)
    assert h == h_twin
    for out, out_twin in zip(outs, outs_twin, strict=True):
        assert sorted(out) == sorted(out_twin)
        for handle in out:
            assert torch.equal(out[handle], out_twin[handle]), f"handle {handle} diverged from the twin"
    assert_unchanged(snapshot(twin), snapshot(rt), "continuing after the refused call")


def test_alone_reference_is_chunking_independent():
    """The reference the lifecycle property uses (one prefill) agrees with the same request fed in chunks
    and decodes, so a lifecycle failure points at interference between requests, not at chunking."""
    seq = list(stream(5)[:MAX_CONTEXT])
    rt = dsv4rt.Runtime(tiny_model(), max_requests=1, max_context=MAX_CONTEXT, max_tokens_per_step=16)
    h = rt.admit()
    sizes = [3, 29, 1, 64, 1, 1, 17]  # windows close mid-chunk and at edges; the 29 and 64 are split in calls
    chunks, i = [], 0
    for s in sizes:
        chunks.append(seq[i:i + s])
        i += s
    chunks += [[t] for t in seq[i:]]
    got = torch.cat([rt.step({h: ch}, all_logits=True)[h] for ch in chunks])
    assert rel_err(got, alone(tuple(seq))) <= TOL


def test_static_block_table_follows_the_host_table(block_rows_copied):
    """Each forward call copies only the block-table rows changed since the last one (all of them in one copy when
    more than a quarter changed): after every step the static inputs' table equals the host table, through
    admissions, block allocation mid-decode, releases and slot reuse, on both copy paths."""
    rt = dsv4rt.Runtime(tiny_model(), max_requests=8, max_context=MAX_CONTEXT, max_tokens_per_step=1024)
    copied = block_rows_copied  # block_rows of each forward call (one call a step here)

    def step(batch):
        rt.step(batch)
        assert torch.equal(rt.inputs.block_table, rt.block_table)

    hs = [rt.admit() for _ in range(4)]
    step({h: list(stream(i)[:128 + i]) for i, h in enumerate(hs)})  # 4 of 9 rows get blocks: the whole table
    assert copied[-1] is None
    step({hs[3]: [1]})  # 131 -> 132 tokens: its second block, one row
    assert copied[-1] == [rt._requests[hs[3]].slot]
    step({h: [2] for h in hs})  # nothing changed: no row
    assert copied[-1] == []
    slot = rt._requests[hs[0]].slot
    rt.release(hs[0])
    step({hs[1]: [3]})  # the released row goes back to the trash block
    assert copied[-1] == [slot]
    h = rt.admit()  # the same slot again, fresh blocks
    step({h: list(stream(9)[:5])})
    assert rt._requests[h].slot == slot and copied[-1] == [slot]


def test_fill_pads_what_the_previous_fill_wrote():
    """prepare.fill pads only up to what the previous fill of the same buffers wrote; after any sequence of calls
    the buffers equal a fresh fill of the last call (padding included), for decode and prefill shapes."""
    from dsv4rt.prepare import Segment, fill

    def fresh(segs, all_logits):
        buf = StepInputs.allocate(64, 4, 2, 9, "cpu")
        fill(buf, segs, all_logits, 64, 4)
        return buf

    calls = [([Segment(0, 0, 5, list(range(40))), Segment(1, 2, 0, [7, 8])], True),
             ([Segment(1, 2, 2, [3])], False),
             ([Segment(0, 0, 45, [1, 2, 3]), Segment(2, 1, 9, [4]), Segment(1, 2, 3, [5])], False),
             ([Segment(3, 3, 0, list(range(64)))], True),
             ([Segment(3, 3, 64, [6])], True)]
    buf, written = StepInputs.allocate(64, 4, 2, 9, "cpu"), (0, 0)
    for segs, all_logits in calls:
        *_, written = fill(buf, segs, all_logits, 64, 4, written)
        want = fresh(segs, all_logits)
        for f in dataclasses.fields(StepInputs):
            assert torch.equal(getattr(buf, f.name), getattr(want, f.name)), f.name


@pytest.mark.parametrize("all_logits", [False, True])
def test_fill_decode_fields(all_logits):
    """prepare.fill's one-token-a-segment form (decode) writes each field as its definition says: the segment's
    token, its position as position and request start, position + 1 as end, its slot, logit row i for segment i."""
    from dsv4rt.prepare import Segment, fill
    for n in (3, 12):  # the general form, then the one-pass-a-field form (8 segments or more)
        segs = [Segment(10 + i, (7 * i) % 13, 3 * i + 5, [100 + i]) for i in range(n)]
        buf = StepInputs.allocate(16, 16, 2, 9, "cpu")
        bucket, n_rows, owners, written = fill(buf, segs, all_logits, 16, 16)
        assert (bucket, written, owners) == (4 if n == 3 else 16, (n, n), [(10 + i, 1) for i in range(n)])
        assert n_rows == bucket
        assert buf.token_ids[:n].tolist() == [100 + i for i in range(n)]
        assert buf.positions[:n].tolist() == buf.start_pos[:n].tolist() == [3 * i + 5 for i in range(n)]
        assert buf.end_pos[:n].tolist() == [3 * i + 6 for i in range(n)]
        assert buf.req_slot[:n].tolist() == [(7 * i) % 13 for i in range(n)]
        assert buf.logit_rows[:n].tolist() == list(range(n))
        assert buf.req_slot[n:].tolist() == [dsv4rt.prepare.PAD_SLOT] * (16 - n)
        assert buf.token_ids[n:].tolist() == [0] * (16 - n)


def test_blocks_needed_one_division_equals_every_rate():
    """KVCache.blocks_needed takes one division by the smallest rate when it divides the others; the general form
    (the largest need over every rate) gives the same counts, here for CSA 4 with HCA 128, 8 and 4 (the last: one
    rate)."""
    for csa, hca in ((4, 128), (4, 8), (4, 4)):
        cfg = dataclasses.replace(dsv4rt.ModelConfig.tiny(), csa_ratio=csa, hca_ratio=hca)
        cache = dsv4rt.cache.KVCache(cfg, max_requests=1, max_context=4096)
        assert cache._rates == tuple(sorted({csa, hca})) and cache._first_rate == csa
        for n in range(0, 3 * BLOCK_TOKENS + 9):
            want = max(-(-(n // m) // (BLOCK_TOKENS // m)) for m in (csa, hca))
            assert cache.blocks_needed(n) == want, (csa, hca, n)
        cache._first_rate = 0  # the general loop
        assert [cache.blocks_needed(n) for n in range(300)] == [max(-(-(n // m) // (BLOCK_TOKENS // m))
                                                                   for m in (csa, hca)) for n in range(300)]
