"""Graph capture and replay of a compiled step function (knows nothing of DSV4). Import as `dsv4rt.graphs`."""
if __name__ != "dsv4rt.graphs":
    raise ImportError(f"import the graph package as `dsv4rt.graphs`, not `{__name__}`")
