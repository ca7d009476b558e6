"""Cache groups: which layers share pages (``ModelConfig.cache_groups``)."""

import pytest
import torch
from hypothesis import given, strategies as st

from tokenspeed.backends.metadata import DecodeRow, ExtendChunk, plan_extend, refresh_decode
from tokenspeed.errors import InternalError
from tokenspeed.ir.cache_groups import CacheGroup, cache_groups, cache_slot, rows_per_page
from tokenspeed.models.config import ModelConfig
from tokenspeed.models.random import TINY_LLAMA


def qwen3(types, window=8, **extra) -> ModelConfig:
    return ModelConfig.from_hf({**TINY_LLAMA, "architectures": ["Qwen3ForCausalLM"], "use_sliding_window": True,
                                "sliding_window": window, "num_hidden_layers": len(types),
                                "layer_types": [f"{t}_attention" for t in types], **extra})


def test_one_retention_keeps_one_group_of_every_layer():
    assert qwen3(["full", "full"]).cache_groups == (CacheGroup(0, (0, 1)),)
    assert qwen3(["sliding", "sliding", "sliding"]).cache_groups == (CacheGroup(8, (0, 1, 2)),)


def test_full_and_windowed_layers_part():
    assert qwen3(["sliding", "full"]).cache_groups == (CacheGroup(0, (1,)), CacheGroup(8, (0,)))
    assert qwen3(["sliding", "full", "sliding", "full"]).cache_groups == \
        (CacheGroup(0, (1, 3)), CacheGroup(8, (0, 2)))


def test_the_larger_kind_is_cut_into_groups_of_the_smaller_s_size():
    """Groups of one size share the pages' rows: 5 windowed layers beside 2 full ones make
    runs of 2, the last of 1 (its pages' second row unused)."""
    groups = qwen3(["full", "sliding", "sliding", "full", "sliding", "sliding", "sliding"]).cache_groups
    assert groups == (CacheGroup(0, (0, 3)), CacheGroup(8, (1, 2)), CacheGroup(8, (4, 5)), CacheGroup(8, (6,)))
    assert rows_per_page(groups) == 2
    assert cache_slot(groups, 5) == (2, 1)


def test_a_windowed_cache_read_by_a_full_layer_is_kept_whole():
    """KV-shared layers read the last writer's cache: a full-attention reader makes the
    writer's retention whole."""
    config = qwen3(["sliding", "sliding", "full"], num_kv_shared_layers=1)
    assert config.kv_source_layer(2) == 1
    assert config.retention_of(1) == 0 and config.retention_of(0) == 8
    assert config.cache_groups == (CacheGroup(0, (1,)), CacheGroup(8, (0,)))


@given(st.dictionaries(st.integers(0, 40), st.sampled_from([0, 4, 8, 4096]), min_size=1))
def test_every_cache_is_in_one_group_of_one_retention(owners):
    num_layers = max(owners) + 1
    groups = cache_groups(owners, num_layers)
    placed = [layer for group in groups for layer in group.layers]
    if len(set(owners.values())) == 1:
        assert groups == (CacheGroup(next(iter(owners.values())), tuple(range(num_layers))),)
        return
    assert sorted(placed) == sorted(owners) and len(placed) == len(set(placed))
    assert all(owners[layer] == group.retention for group in groups for layer in group.layers)
    smallest = min(list(owners.values()).count(r) for r in set(owners.values()))
    assert rows_per_page(groups) == smallest
    assert [g.retention for g in groups] == sorted(g.retention for g in groups)
    assert all(cache_slot(groups, layer) == (g, i) for g, group in enumerate(groups)
               for i, layer in enumerate(group.layers))


@given(st.data())
def test_each_group_s_column_is_the_metadata_of_its_pages(data):
    """Stacked metadata: group g's column of the tables and write locations equals the
    one-group metadata built from group g's pages, for decode rows and extend chunks."""
    page_size, num_groups = data.draw(st.sampled_from([1, 4])), data.draw(st.integers(2, 3))
    lengths = data.draw(st.lists(st.integers(1, 12), min_size=1, max_size=4))
    lists = [[tuple(data.draw(st.lists(st.integers(0, 50), min_size=-(-n // page_size) + 1,
                                       max_size=-(-n // page_size) + 1))) for _ in range(num_groups)]
             for n in lengths]
    rows = [DecodeRow(7, n - 1, pages[0], tuple(pages[1:])) for n, pages in zip(lengths, lists)]
    chunks = [ExtendChunk((3,) * n, 0, pages[0], True, tuple(pages[1:])) for n, pages in zip(lengths, lists)]
    stacked = (refresh_decode(rows, 6, 16, page_size, num_groups=num_groups),
               plan_extend(chunks, 64, len(chunks) + 1, 16, page_size, num_groups=num_groups))
    for g in range(num_groups):
        alone = (refresh_decode([DecodeRow(7, r.position, p[g]) for r, p in zip(rows, lists)], 6, 16, page_size),
                 plan_extend([ExtendChunk(c.tokens, 0, p[g], True) for c, p in zip(chunks, lists)], 64,
                             len(chunks) + 1, 16, page_size))
        for both, one in zip(stacked, alone):
            assert torch.equal(both.block_tables[:, g], one.block_tables)
            assert torch.equal(both.slot_mapping[:, g], one.slot_mapping)


def test_rows_without_every_group_s_pages_are_refused():
    with pytest.raises(InternalError, match="the model has 2 groups"):
        refresh_decode([DecodeRow(1, 0, (1,))], 2, 4, 4, num_groups=2)
    with pytest.raises(InternalError, match="one entry per page"):
        refresh_decode([DecodeRow(1, 0, (1,), ((2, 3),))], 2, 4, 4, num_groups=2)


def test_every_segment_reads_the_stacked_inputs_themselves():
    """A grouped model's layers read their group's column of ``block_tables`` and
    ``slot_mapping``; each segment takes its columns of the inputs themselves (a captured
    graph reads the pinned slot), never from another segment."""
    import tokenspeed as ts
    from tokenspeed.models.random import random_model
    config = {**TINY_LLAMA, "architectures": ["Qwen3ForCausalLM"], "use_sliding_window": True, "sliding_window": 8,
              "layer_types": ["sliding_attention", "full_attention"]}
    traced = ts.trace(random_model(config))
    for lowered in (traced.lower("prefill"), traced.lower("decode")):
        names = {s.name: s for s in lowered.segments}
        produced = {out for s in lowered.segments for out in s.outputs}
        for segment in names.values():
            columns = [n for n in segment.graph_module.graph.nodes if n.op == "call_function"
                       and "getitem" in str(n.target) and n.args[0].op == "placeholder"]
            assert {n.args[0].name for n in columns} <= {"block_tables", "slot_mapping"}
            assert not {n.name for n in columns} & set(segment.inputs)
            assert not {n.name for n in columns} & produced
        assert any(n.args[0].name == "block_tables" for s in lowered.segments
                   for n in s.graph_module.graph.nodes if n.op == "call_function" and "getitem" in str(n.target)
                   and n.args[0].op == "placeholder")
