"""Cache groups: layers whose caches keep the same positions, each group with its own
pages per request, so a windowed group returns the pages behind its window to the pool
while the request runs and the full-attention layers keep every page.

All groups share one cache tensor and one page space: a page id belongs to one group of
one request at a time, and group g's layers use rows 0..len-1 of every page, so the tensor
has as many layer rows as the largest group. Groups are therefore of one size: each
retention's layers in runs of the smallest retention's count, as vLLM's hybrid allocator
does (a shorter last run leaves rows of its pages unused). A model of one retention keeps
one group of every layer, row = layer: today's layout.
"""

from collections.abc import Sequence

import attrs


@attrs.frozen
class CacheGroup:
    retention: int             # positions behind a row that its layers read (0: all of them)
    layers: tuple[int, ...]    # the layers whose caches it holds: layers[i] is row i


def cache_groups(owner_retentions: dict[int, int], num_layers: int) -> tuple[CacheGroup, ...]:
    """``owner_retentions``: the retention of every layer that owns a cache (others read
    another layer's); full-attention groups (retention 0) first."""
    kinds = sorted(set(owner_retentions.values()))
    if len(kinds) == 1:
        return (CacheGroup(kinds[0], tuple(range(num_layers))),)
    by_kind = {r: [layer for layer, k in sorted(owner_retentions.items()) if k == r] for r in kinds}
    size = min(map(len, by_kind.values()))
    return tuple(CacheGroup(r, tuple(layers[i:i + size]))
                 for r, layers in by_kind.items() for i in range(0, len(layers), size))


def cache_slot(groups: Sequence[CacheGroup], layer: int) -> tuple[int, int]:
    """(group, row) of the cache ``layer`` owns."""
    for g, group in enumerate(groups):
        if layer in group.layers:
            return g, group.layers.index(layer)
    raise ValueError(f"layer {layer} owns no cache in {groups}")


def rows_per_page(groups: Sequence[CacheGroup]) -> int:
    """Layer rows of the cache tensor: the largest group's."""
    return max(len(group.layers) for group in groups)
