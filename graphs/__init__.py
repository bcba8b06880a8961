"""Graph capture and replay of a compiled step function (knows nothing of DSV4). Import as `dsv4rt.graphs`."""
if __name__ != "dsv4rt.graphs":  # a second import name would create a second module with its own state
    raise ImportError(f"import the graph package as `dsv4rt.graphs`, not `{__name__}`")

from .backend import aot_eager_inplace, inplace_report  # noqa: E402
from .runner import GraphRunner  # noqa: E402

__all__ = ["GraphRunner", "aot_eager_inplace", "inplace_report"]
