"""CPU prefill (issue 30): the CPU's paged attention equals a naive per-row oracle and
attends each request's rows in one SDPA call, and a long prompt's prefill runs in chunks
by default, so a request that arrives meanwhile is served before it completes."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

import tokenspeed as ts
from tokenspeed.backends.kernels import reference
from tokenspeed.models.random import TINY_LLAMA
from tokenspeed.execution.compile_config import CPU_CHUNK_TOKENS, CompileConfig

from hf_models import copy_checkpoint, edit_config, make_prompts
from hf_models import reference as hf_reference
from margins import decisive_model

HEAD_DIM, LAYER, SCALE = 8, 1, 0.35


@st.composite
def paged_batches(draw):
    """Requests of ``context`` tokens whose last ``rows`` are queried (an extend after
    ``context - rows`` cached ones; one row is a decode row), on pages drawn at random."""
    page_size = draw(st.sampled_from([1, 2, 4, 16]))
    kv_heads, group = draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 3]))
    window = draw(st.sampled_from([0, 1, 3, 9]))
    shapes = draw(st.lists(st.integers(1, 40).flatmap(lambda n: st.tuples(st.just(n), st.integers(1, n))),
                           min_size=1, max_size=4))
    padding = draw(st.integers(0, 3))
    return page_size, kv_heads, group, window, shapes, padding, draw(st.integers(0, 2**16))


def build(page_size, kv_heads, group, shapes, padding, seed):
    """(q, kv_cache, block_tables, row_request, positions, dense K/V per request, live rows)."""
    gen = torch.Generator().manual_seed(seed)
    pages_each = [-(-context // page_size) for context, _ in shapes]
    order = (torch.randperm(sum(pages_each), generator=gen) + 1).tolist()   # page 0: null
    kv_cache = torch.zeros(2, 2, sum(pages_each) + 1, page_size, kv_heads, HEAD_DIM)
    tables = torch.zeros(len(shapes) + 1, max(pages_each), dtype=torch.int32)
    dense, row_request, positions = [], [], []
    for i, ((context, rows), count) in enumerate(zip(shapes, pages_each)):
        tables[i, :count] = torch.tensor(order[:count], dtype=torch.int32)
        order = order[count:]
        kv = torch.randn(2, context, kv_heads, HEAD_DIM, generator=gen)
        pos = torch.arange(context)
        kv_cache[LAYER][:, tables[i, pos // page_size].long(), pos % page_size] = kv
        dense.append(kv)
        row_request += [i] * rows
        positions += range(context - rows, context)
    live = len(positions)
    row_request += [len(shapes)] * padding   # padding rows read the null table row
    positions += [0] * padding
    q = torch.randn(live + padding, kv_heads * group, HEAD_DIM, generator=gen)
    return q, kv_cache, tables, torch.tensor(row_request), torch.tensor(positions), dense, live


def naive_attention(q, row_request, positions, dense, window: int, live: int) -> torch.Tensor:
    """Row by row in float64: softmax over the request's keys at or before the row's
    position (within the window), each query head reading its KV head."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    group = q.shape[1] // dense[0].shape[2]
    for r in range(live):
        pos = int(positions[r])
        k, v = (x[max(pos - window + 1, 0) if window else 0:pos + 1].double()
                for x in dense[int(row_request[r])])
        for h in range(q.shape[1]):
            weights = (k[:, h // group] @ q[r, h].double() * SCALE).softmax(0)
            out[r, h] = weights @ v[:, h // group]
    return out


@settings(max_examples=60, deadline=None)
@given(paged_batches())
def test_cpu_attention_equals_the_naive_oracle(batch):
    page_size, kv_heads, group, window, shapes, padding, seed = batch
    q, kv_cache, tables, row_request, positions, dense, live = build(page_size, kv_heads, group, shapes,
                                                                      padding, seed)
    want = naive_attention(q, row_request, positions, dense, window, live)
    tiles = torch.tensor([0, live], dtype=torch.int32)
    got = reference.extend_attention(q, kv_cache, LAYER, tables, row_request, positions, tiles, SCALE, window)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    for op in (reference.attention, reference.decode_attention):   # decode: row by row
        got = op(q[:live], kv_cache, LAYER, tables, row_request[:live], positions[:live], SCALE, window)
        torch.testing.assert_close(got.double(), want[:live], atol=1e-5, rtol=1e-5)


def test_bfloat16_rows_are_attended_in_float32():
    q, kv_cache, tables, row_request, positions, dense, live = build(4, 2, 3, [(30, 30), (9, 1)], 0, 7)
    want = naive_attention(q.bfloat16().float(), row_request, positions,
                           [d.bfloat16().float() for d in dense], 0, live)
    got = reference.attention(q.bfloat16(), kv_cache.bfloat16(), LAYER, tables, row_request, positions,
                              SCALE, 0)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), want, atol=2e-2, rtol=2e-2)


def test_a_request_s_rows_make_one_sdpa_call(monkeypatch):
    """Two chunks and two decode rows: the chunks' rows are attended in one call each
    (their keys gathered once, ``[heads, rows, D]``), the decode rows together in one more
    (``[rows, KV heads, group, D]``: each KV head's query heads as its query rows)."""
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda q, *args, **kwargs: calls.append(tuple(q.shape[:-1])) or sdpa(q, *args, **kwargs))
    q, kv_cache, tables, row_request, positions, _, live = build(4, 2, 3, [(300, 200), (9, 1), (70, 70), (5, 1)],
                                                                 0, 3)
    reference.attention(q, kv_cache, LAYER, tables, row_request, positions, SCALE, 0)
    heads, kv_heads = q.shape[1], kv_cache.shape[4]
    assert calls == [(heads, 200), (heads, 70), (2, kv_heads, heads // kv_heads)]


def test_the_cpu_chunks_prompts_by_default_and_cuda_keeps_its_budget():
    assert CompileConfig().chunk_tokens() == CPU_CHUNK_TOKENS
    assert CompileConfig(max_num_batched_tokens=100).chunk_tokens() == 100
    assert CompileConfig(device="cuda").chunk_tokens() == 2048
    assert CompileConfig(max_chunk_tokens=64).chunk_tokens() == 64
    with pytest.raises(ValueError, match=r"max_chunk_tokens=4096: must be in \[1, max_num_batched_tokens=2048\]"):
        CompileConfig(max_chunk_tokens=4096)


LONG_LLAMA = {**TINY_LLAMA, "max_position_embeddings": 2048}


def recorded_chunks(llm) -> list[list[tuple[int, int]]]:
    """Each prefill step's chunks as (request's first position, new tokens)."""
    steps, launch = [], llm.engine.prefill.launch

    def recording(chunks, *args, **kwargs):
        steps.append([(c.start, len(c.tokens)) for c in chunks])
        return launch(chunks, *args, **kwargs)
    llm.engine.prefill.launch = recording
    return steps


def test_a_short_request_finishes_while_a_long_prompt_prefills():
    llm = ts.LLM(decisive_model(3, LONG_LLAMA))
    steps, engine = recorded_chunks(llm), llm.engine
    prompt = tuple(make_prompts([1500], seed=4, vocab=512)[0])
    [long] = engine.add(prompt, ts.SamplingParams(temperature=0, max_tokens=1))
    engine.step()
    [short] = engine.add((5, 6, 7, 8), ts.SamplingParams(temperature=0, max_tokens=2))
    while not short.finished:
        engine.step()
    assert long.num_cached < len(prompt)
    while engine.has_work:
        engine.step()
    starts = [start for step in steps for start, n in step if n > 4]
    assert starts == list(range(0, len(prompt), CPU_CHUNK_TOKENS))   # the long prompt's chunks
    assert steps[1] == [(CPU_CHUNK_TOKENS, CPU_CHUNK_TOKENS), (0, 4)]  # the short one joined at once
    assert long.finish_reason == "length" and len(long.output) == 1


@pytest.mark.parametrize("variant", ["llama", "mistral"])
def test_long_prompts_chunked_on_the_cpu_keep_hf_tokens(variant):
    """GQA (and, for Mistral, a sliding window of 8) over a prompt of three default chunks."""
    path = copy_checkpoint(variant)
    edit_config(path, max_position_embeddings=1024)
    llm = ts.LLM(str(path))
    steps = recorded_chunks(llm)
    prompts = make_prompts([700, 3], seed=21)
    outputs = llm.generate(prompts, ts.SamplingParams(temperature=0, max_tokens=6))
    assert [o.token_ids for o in outputs] == hf_reference(variant, prompts, 6)
    assert max(n for step in steps for _, n in step) == CPU_CHUNK_TOKENS
