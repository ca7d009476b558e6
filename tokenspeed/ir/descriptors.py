"""Frozen metadata descriptors: everything a forward step reads besides the weights and cache.

A descriptor's tensor fields are graph inputs (they are registered as a pytree, and the
tracer makes one placeholder per leaf); its static fields (plain ints) describe the batch
to the host and never enter a graph. Descriptors are built only by the pure functions in
``tokenspeed.backends.metadata`` and published into slots by the runtime.
"""

import attrs
import torch
import torch.utils._pytree as pytree


def static(**kwargs):
    return attrs.field(metadata={"static": True}, **kwargs)


@attrs.frozen
class ForwardMetadata:
    """What every program reads: token rows, their cache addresses and the sampled rows."""
    input_ids: torch.Tensor       # [rows] int64
    positions: torch.Tensor       # [rows] int64
    slot_mapping: torch.Tensor    # [rows] int64, write slot of each row's K/V
    block_tables: torch.Tensor    # [table rows, max_pages] int32, padding rows all page 0
    row_request: torch.Tensor     # [rows] int64, the table row each row reads through
    state_slots: torch.Tensor     # [rows] int64, the recurrent state slot of each row's request (its seat)
    sample_rows: torch.Tensor     # [sampled] int64, rows whose logits are returned
    num_live_rows: int = static()


@attrs.frozen
class DecodeMetadata(ForwardMetadata):
    """One row per request; rows ``[num_live_rows, rows)`` are padding. Every row is
    sampled (``sample_rows`` is ``0 .. rows - 1``): decode lowering drops the gather
    (``drop_sample_gather``), so a backend's ``refresh_decode`` must keep it so."""


@attrs.frozen
class ExtendMetadata(ForwardMetadata):
    """Prefill chunks of several requests, plus the decoder view the narrowing keeps:
    ``view_rows`` are the token rows kept, ``view_sample_rows`` index the view.
    ``attention_tiles`` and ``view_attention_tiles``: the live token rows and view rows
    grouped by request into the attention kernel's tiles (``ops.extend_attention``)."""
    view_rows: torch.Tensor = attrs.field(kw_only=True)
    view_sample_rows: torch.Tensor = attrs.field(kw_only=True)
    attention_tiles: torch.Tensor = attrs.field(kw_only=True)        # [tiles + 1] int32
    view_attention_tiles: torch.Tensor = attrs.field(kw_only=True)   # [view tiles + 1] int32
    num_live_view_rows: int = static(kw_only=True)


def tensor_fields(cls) -> tuple[str, ...]:
    return tuple(f.name for f in attrs.fields(cls) if not f.metadata.get("static"))


def static_fields(cls) -> tuple[str, ...]:
    return tuple(f.name for f in attrs.fields(cls) if f.metadata.get("static"))


def leaves(desc) -> dict[str, torch.Tensor]:
    return {name: getattr(desc, name) for name in tensor_fields(type(desc))}


def _register(cls):
    tensors, statics = tensor_fields(cls), static_fields(cls)

    def flatten(d):
        return [getattr(d, n) for n in tensors], tuple(getattr(d, n) for n in statics)

    def flatten_with_keys(d):
        return [(pytree.GetAttrKey(n), getattr(d, n)) for n in tensors], flatten(d)[1]

    def unflatten(values, context):
        return cls(**dict(zip(tensors, values)), **dict(zip(statics, context)))

    pytree.register_pytree_node(cls, flatten, unflatten, flatten_with_keys_fn=flatten_with_keys)


for _cls in (ForwardMetadata, DecodeMetadata, ExtendMetadata):
    _register(_cls)
