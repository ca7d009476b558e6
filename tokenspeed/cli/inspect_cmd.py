"""``tokenspeed inspect``: print a model's lowered program (segments, stages, the pass
history) and, with ``--dot``, write its segment graph for Graphviz; with ``--compiled``,
what a compiled engine runs (its pool, its graphs and the kernels each decode graph
launches, counted on a GPU). The model's modules are imported when the command runs, so
that ``tokenspeed --help`` does not import torch."""

import gc

from tokenspeed.cli.arg_types import file_to_write

DESCRIPTION = ("print a model's lowered program (its segments, stages and the pass history); with --dot, "
               "write its segment graph for Graphviz; with --compiled, compile it and print what runs")


def add_command(commands) -> None:
    command = commands.add_parser("inspect", help="print the lowered program of a model",
                                  description=DESCRIPTION)
    command.add_argument("--model", default=None,
                         help="a Hugging Face model directory or id (owner/name) or a GGUF file (default: the embedded SmolLM2)")
    command.add_argument("--mode", choices=("prefill", "decode"), default="prefill",
                         help="the program of a prompt's steps or of a decode step")
    command.add_argument("--attention-breaks", action="store_true",
                         help="prefill: every attention in an eager break (the lowering for a backend "
                              "that cannot capture it), not inside its stage's graph")
    command.add_argument("--full", action="store_true", help="print every segment's IR")
    command.add_argument("--history", action="store_true", help="print the IR after every pass")
    command.add_argument("--dot", type=file_to_write, default=None, metavar="FILE",
                         help="write the segment graph as DOT")
    command.add_argument("--compiled", action="store_true",
                         help="also compile the model as ts.LLM does and print what runs: the KV pool, the "
                              "graphs captured and, on a GPU, the kernels each decode graph launches")
    command.add_argument("--device", default=None,
                         help="with --compiled: cpu or cuda (default: cuda when a GPU is available, else cpu)")
    command.set_defaults(run=run)


def run(args) -> None:
    """The device is checked before anything prints: a GPU named where there is none is
    refused at once, not after the lowered program."""
    if args.device is not None and not args.compiled:
        raise ValueError(f"--device {args.device} names where --compiled compiles the model: give --compiled too")
    if args.attention_breaks and args.mode != "prefill":
        raise ValueError("--attention-breaks lowers the prefill program; a decode step's attention stays in its "
                         "graph: leave it out with --mode decode")
    if args.device is not None:
        from tokenspeed.api.llm_arguments import checked_device
        checked_device(args.device)
    print_lowered(args)
    if args.compiled:
        gc.collect()   # the lowered program's model (graph modules hold cycles) before another loads
        print("\n" + compiled_text(args))


def print_lowered(args) -> None:
    """The model as ``ts.LLM`` loads it on the CPU (a GGUF file's blocks kept: its products
    read ``'Q4_1'`` and the like)."""
    from tokenspeed import stages
    from tokenspeed.api.model_source import as_model
    from tokenspeed.models.gguf import default_model_path
    model = as_model(args.model or default_model_path(), None, "cpu")
    breaks = {"attention_breaks": True} if args.attention_breaks else {}   # a prefill option
    lowered = stages.trace(model).lower(args.mode, **breaks)
    print(summary(lowered))
    for stage, segments in lowered.stages.items():
        print(f"  stage {stage}: " + ", ".join(s.name for s in segments))
    print("pass history: " + " -> ".join(h.pass_name for h in lowered.history))
    if args.full:
        print("\n" + lowered.as_text())
    if args.history:
        for entry in lowered.history:
            print(f"\n# after {entry.pass_name}\n{entry.text}")
    if args.dot:
        write_dot(lowered, args.dot)
        print(f"segment graph written to {args.dot}")


def compiled_text(args) -> str:
    """``Compiled.as_text()`` of the model as ``ts.LLM`` compiles it on ``--device``."""
    from tokenspeed.api.llm import LLM
    from tokenspeed.cli.main import default_device
    from tokenspeed.models.gguf import default_model_path
    return LLM(args.model or default_model_path(), device=args.device or default_device()).compiled.as_text()


def summary(lowered) -> str:
    kinds = [s.kind for s in lowered.segments]
    return (f"{lowered.mode}: {len(kinds)} segments ({kinds.count('graph')} graph, "
            f"{kinds.count('break')} break)")


def write_dot(lowered, path: str) -> None:
    """Graphviz DOT of ``lowered.to_networkx()``: graph segments as boxes, breaks as
    ellipses, edges labelled with the values they carry."""
    import networkx as nx
    g = nx.DiGraph()
    for name, data in lowered.to_networkx().nodes(data=True):
        g.add_node(name, shape="box" if data["kind"] == "graph" else "ellipse",
                   label=f"{name}\n{data['stage']}")
    for a, b, data in lowered.to_networkx().edges(data=True):
        values = data["values"]
        g.add_edge(a, b, label=", ".join(values[:3]) + (" ..." if len(values) > 3 else ""))
    nx.nx_pydot.write_dot(g, path)
