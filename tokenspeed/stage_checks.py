"""What each stage refuses before it does any work: options of another mode, metadata that
lacks a field a program reads, programs of two models compiled together, state pools too
small for ``max_num_seqs``, a prefill attention the backend cannot capture. Each names
the bad value and what to pass instead."""

from typing import TYPE_CHECKING

import torch

from tokenspeed.backends.support import CudaGraphSupport
from tokenspeed.execution.compile_config import CompileConfig
from tokenspeed.ir.ops import ATTENTION_TARGETS

if TYPE_CHECKING:
    from tokenspeed.stages import Lowered, Verification


LOWER_OPTIONS = {"prefill": ("narrow", "attention_breaks"), "decode": ("decode_graph",), "verify": ("decode_graph",)}


def check_lower_options(mode, **options) -> None:
    """Each option given (not None) is a bool and one of ``mode``'s (``LOWER_OPTIONS``)."""
    if mode not in LOWER_OPTIONS:
        raise ValueError(f"lower(mode={mode!r}): expected one of {', '.join(map(repr, LOWER_OPTIONS))}")
    for name, value in options.items():
        if value is None:
            continue
        if not isinstance(value, bool):
            raise TypeError(f"lower({mode!r}, {name}={value!r}): must be True, False or None")
        if name not in LOWER_OPTIONS[mode]:
            modes = " and ".join(m for m, names in LOWER_OPTIONS.items() if name in names)
            raise ValueError(f"lower({mode!r}, {name}={value!r}): {name} lowers {modes} only; "
                             f"{mode}'s options are {', '.join(LOWER_OPTIONS[mode])}")


METADATA_OF = {"prefill": "an ExtendMetadata (backends.metadata.plan_extend)",
               "decode": "a DecodeMetadata (backends.metadata.refresh_decode)",
               "verify": "a DecodeMetadata (backends.metadata.refresh_decode)"}


def check_metadata(meta, needed, what: str, expected: str) -> None:
    """Every metadata tensor ``what`` reads is on ``meta``: a decode descriptor handed to
    a prefill program is named as such, not met as a KeyError deep in a segment."""
    missing = [name for name in needed if not isinstance(getattr(meta, name, None), torch.Tensor)]
    if missing:
        raise TypeError(f"{what} reads {', '.join(missing)}, which the metadata given "
                        f"({type(meta).__name__}) lacks: pass {expected}")


def check_one_model(prefill: "Lowered", decode: "Lowered", verify: "Verification | None") -> None:
    """The runners share one KV pool sized and laid out by decode's model: a prefill (or
    verify) lowered from another model would write keys of another shape, or of other
    weights, into it. Configs are compared, so two loads of one checkpoint pass."""
    for name, lowered in (("prefill", prefill), ("verify", verify.lowered if verify else None)):
        if lowered is not None and lowered.config != decode.config:
            raise ValueError(f"compile(prefill, decode): the {name} program was lowered from another model "
                             f"than the decode program; lower both from one ts.trace(model)")


def check_state_slots(decode: "Lowered", config: CompileConfig) -> None:
    """A request's recurrent state lives at its seat (1..``max_num_seqs``): the model's state
    pools, which the traced graphs read by address, need that many slots and the null one."""
    gm = decode.program.graph_module
    for node in gm.graph.nodes:
        if node.op == "get_attr" and node.target.endswith("state_pools.conv"):
            slots = gm.get_buffer(node.target).shape[1]
            if slots < config.max_num_seqs + 1:
                raise ValueError(f"max_num_seqs={config.max_num_seqs}: the model's state pools hold {slots} slots "
                                 f"(the null slot and {slots - 1} sequences); size them before tracing with "
                                 f"model.model.state_pools.allocate({config.max_num_seqs + 1}), as ts.LLM does")
            return


def check_prefill_attention(prefill: "Lowered", support: CudaGraphSupport) -> None:
    """A graph segment with an attention would capture it: refused for a backend that
    cannot capture its prefill attention, before anything is bound."""
    captured = [seg.name for seg in prefill.segments if seg.kind == "graph" and
                any(n.target in ATTENTION_TARGETS for n in seg.graph_module.graph.nodes)]
    if captured and not support.prefill_attention:
        raise ValueError(f"the backend cannot capture prefill attention (prefill_attention=False), "
                         f"but segment {captured[0]} holds one: lower prefill with attention_breaks=True")
