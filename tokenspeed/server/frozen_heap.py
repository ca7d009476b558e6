"""A serving process's startup heap, left out of the garbage collector's full collections.

Serving allocates steadily (a record per token, per stream), so the collector's full
collections come every few seconds, and each walks every object the process holds: the
model and its graphs in the engine process, the modules and tokenizer in an HTTP process
(and, in a benchmark serving from its own process, the model it runs offline too). While
one runs, the process's event loop or engine thread stops, and every stream with it: on
the H200's host a full collection of the benchmark's HTTP process took 200-290 ms, at
64 clients (docs/PERFORMANCE.md). Objects frozen once started are never walked again, as
vLLM's servers do.
"""

import contextlib
import gc


@contextlib.contextmanager
def frozen_heap():
    """Freeze what the process holds now for the block; unfreeze after it, since frozen
    objects outlive the interpreter's last collection and Triton's bindings then list
    each of them as leaked at exit (some 70 lines). Not nested: the unfreeze releases
    every frozen object, whoever froze it (a process serves one such block)."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
