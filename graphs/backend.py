"""`aot_eager` with the mutations of custom ops done in place (knows nothing of DSV4).

torch.compile functionalizes every op that mutates its arguments (a `Tensor(a!)` in its schema): the traced graph
calls `auto_functionalized_v2`, which clones each mutated tensor, runs the op on the clone and returns it, and the
graph ends with `copy_` of each clone back into the input. Inductor's post-grad passes undo this (reinplacing); the
`aot_eager` backend runs the functional graph as traced. For a step that writes its caches through custom ops that
is two full copies of every cache a step, from a graph pool that then holds a second copy of each cache.

`aot_eager_inplace` is `aot_eager` (AOT autograd's trace, run without code generation) with Inductor's two passes
applied to the forward graph: `reinplace_inplaceable_ops` marks which mutated bases need no clone (a graph input
whose only later use is the epilogue's `copy_` back) and makes each of those `copy_` nodes a copy of the input onto
itself (dropped here), and `decompose_auto_functionalized` turns each `auto_functionalized_v2` into the mutable op
itself, on the input, plus a clone of only those bases the pass kept. `inplace_report(gm)` counts what is left of
both, for tests. The passes are Inductor internals: their signatures are looked up, and a torch whose passes fail
fails the compile with their error (no silent fall back to the copies).
"""
from __future__ import annotations

import inspect
from typing import Any, Callable

import torch
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func

_AUTO_FUNCTIONALIZED = ("auto_functionalized", "auto_functionalized_v2")


def _reinplace(gm: torch.fx.GraphModule) -> None:
    from torch._inductor.fx_passes.post_grad import decompose_auto_functionalized
    from torch._inductor.fx_passes.reinplace import reinplace_inplaceable_ops

    params = inspect.signature(reinplace_inplaceable_ops).parameters
    if len(params) == 2:  # (fake_tensor_updater, graph)
        from torch._inductor.fx_utils import FakeTensorUpdater

        takes_module = "gm" in inspect.signature(FakeTensorUpdater.__init__).parameters  # else an older `graph`
        reinplace_inplaceable_ops(FakeTensorUpdater(gm if takes_module else gm.graph), gm.graph)
    else:
        reinplace_inplaceable_ops(gm.graph)
    try:
        from torch._inductor.fx_passes.post_grad import fix_auto_functionalized_dtype_views
    except ImportError:
        pass
    else:
        fix_auto_functionalized_dtype_views(gm.graph)
    decompose_auto_functionalized(gm.graph)
    for n in list(gm.graph.nodes):  # the epilogue's copy_(x, x) of each input now written in place
        if n.op == "call_function" and n.target is torch.ops.aten.copy_.default and n.args[0] is n.args[1] \
                and not n.users:
            gm.graph.erase_node(n)
    gm.graph.lint()
    gm.recompile()


def inplace_report(gm: torch.fx.GraphModule) -> dict[str, int]:
    """Nodes of a forward graph that copy a mutated tensor: `auto_functionalized*` calls left, `copy_` into a graph
    input, and clones of a graph input."""
    placeholders = {n for n in gm.graph.nodes if n.op == "placeholder"}
    rep = {"auto_functionalized": 0, "copy_to_input": 0, "clone_of_input": 0}
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        name = getattr(n.target, "__name__", str(n.target))
        if name in _AUTO_FUNCTIONALIZED:
            rep["auto_functionalized"] += 1
        elif n.target is torch.ops.aten.copy_.default and n.args[0] in placeholders:
            rep["copy_to_input"] += 1
        elif n.target is torch.ops.aten.clone.default and n.args[0] in placeholders:
            rep["clone_of_input"] += 1
    return rep


def make_backend(on_graph: Callable[[torch.fx.GraphModule], Any] | None = None) -> Callable[..., Any]:
    """The backend; `on_graph(gm)` (tests) sees each forward graph after the passes."""

    def fw_compiler(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        _reinplace(gm)
        if on_graph is not None:
            on_graph(gm)
        return make_boxed_func(gm.forward)

    return aot_autograd(fw_compiler=fw_compiler, keep_inference_input_mutations=True)


aot_eager_inplace = make_backend()


def resolve(backend: Any) -> Any:
    """The backend torch.compile gets for a name: "aot_eager" is `aot_eager_inplace`, "aot_eager_functional" is
    torch's own "aot_eager" (the functional graph as traced: for comparisons); anything else (a name torch.compile
    knows, such as "inductor", which reinplaces itself, or a callable) is passed as given."""
    return {"aot_eager": aot_eager_inplace, "aot_eager_functional": "aot_eager"}.get(backend, backend) \
        if isinstance(backend, str) else backend
