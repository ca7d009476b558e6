"""Named passes over Programs, run in order with invariant checks after each.

A pass is a plain function ``Program -> Program``; ``@program_pass`` gives it the name
recorded in a lowering's history, and ``@graph_pass`` makes one from a function that
edits a copy of the program's graph in place.
"""

import functools

import attrs
from tokenspeed.ir.program import Program, copy_graph


def program_pass(name: str):
    def wrap(fn):
        @functools.wraps(fn)
        def run(program: Program, **options) -> Program:
            return fn(program, **options)
        run.pass_name = name
        return run
    return wrap


def graph_pass(name: str):
    """A named pass from ``fn(gm, **options)``, which edits ``gm`` in place: ``gm`` is a
    copy, so the input program (kept in the history) stays valid, and the copy, its code
    generated when it is first called (``copy_graph``), is the returned program's."""
    def wrap(fn):
        @program_pass(name)
        @functools.wraps(fn)
        def run(program: Program, **options) -> Program:
            gm = copy_graph(program.graph_module)
            fn(gm, **options)
            gm.recompile()
            return program.evolve(graph_module=gm)
        return run
    return wrap


@attrs.frozen
class HistoryEntry:
    pass_name: str
    text: str

    def __iter__(self):
        return iter((self.pass_name, self.text))


def run_passes(program: Program, passes, **options) -> tuple[Program, tuple[HistoryEntry, ...]]:
    history = [HistoryEntry("trace", program.as_text())]
    for p in passes:
        program = p(program, **options)
        check_program(program, p.pass_name)
        history.append(HistoryEntry(p.pass_name, program.as_text()))
    return program, tuple(history)


def check_program(program: Program, after: str) -> None:
    """Graph well-formedness, and every segment input defined before it is read."""
    program.graph_module.graph.lint()
    defined = {n.name for n in program.graph_module.graph.nodes if n.op == "placeholder"}
    for seg in program.segments:
        missing = [name for name in seg.inputs if name not in defined]
        if missing:
            raise AssertionError(f"after pass {after}: segment {seg.name} reads {missing} "
                                 "before any segment defines them")
        defined.update(seg.outputs)

