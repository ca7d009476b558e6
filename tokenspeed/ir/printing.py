"""IR text: one line per node, with the stage and segment annotations passes add."""

from torch import fx


def node_text(node: fx.Node) -> str:
    if node.op == "placeholder":
        return f"%{node.name} = input"
    if node.op == "output":
        return f"return {_arg(node.args[0])}"
    if node.op == "get_attr":
        return f"%{node.name} = weight {node.target}"
    args = ", ".join([_arg(a) for a in node.args] + [f"{k}={_arg(v)}" for k, v in node.kwargs.items()])
    call = f"{_target(node)}({args})"
    return call if not node.users and node.op == "call_function" else f"%{node.name} = {call}"


def graph_text(graph: fx.Graph, annotate: tuple[str, ...] = ()) -> str:
    lines = []
    for node in graph.nodes:
        notes = [f"{k}={node.meta[k]}" for k in annotate if k in node.meta]
        lines.append("  " + node_text(node) + (f"    # {' '.join(notes)}" if notes else ""))
    return "\n".join(lines)


def _target(node: fx.Node) -> str:
    if node.op == "call_module":
        return node.target
    if node.op == "call_method":
        return f".{node.target}"
    name = getattr(node.target, "__name__", str(node.target))
    module = getattr(node.target, "__module__", "") or ""
    if str(node.target).startswith("tokenspeed."):
        return str(node.target).removesuffix(".default")
    if module.startswith("torch") and module != "torch":
        return f"torch.{name}"
    return {"getitem": "getitem", "add": "add", "mul": "mul", "neg": "neg"}.get(name, name)


def _arg(a) -> str:
    if isinstance(a, fx.Node):
        return f"%{a.name}"
    if isinstance(a, (list, tuple)):
        inner = ", ".join(_arg(x) for x in a)
        return f"[{inner}]" if isinstance(a, list) else f"({inner}{',' if len(a) == 1 else ''})"
    if isinstance(a, slice):
        return ":".join("" if x is None else _arg(x) for x in (a.start, a.stop, a.step))
    return repr(a)
