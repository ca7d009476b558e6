"""Property tests of the slot and padding invariants (docs/DESIGN.md invariants 1-3) and the allocator."""

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from tokenspeed.backends.metadata import kept_rows, plan_extend, refresh_decode, write_locations
from tokenspeed.scheduling.block_allocator import BlockAllocator, OutOfPages
from tokenspeed.errors import InternalError
from tokenspeed.testing import invariants as inv
from tokenspeed.engine.speculative import window_rows
from tokenspeed.testing.strategies import block_tables, decode_cases, extend_cases, verify_cases

DECODE_FIELDS = ("input_ids", "positions", "slot_mapping", "block_tables", "row_request")


def expand_block_table(block_tables: torch.Tensor, factor: int) -> torch.Tensor:
    """The same table over pages ``factor`` times smaller: page p becomes pages
    p*factor .. p*factor + factor - 1 (page 0 stays the null range)."""
    sub = torch.arange(factor, dtype=block_tables.dtype)
    return (block_tables[:, :, None] * factor + sub).flatten(1)


@given(tables=block_tables(), factor=st.sampled_from([1, 2, 4]), page_size=st.sampled_from([4, 8, 16]),
       data=st.data())
def test_slot_math_is_page_size_invariant(tables, factor, page_size, data):
    width = max(map(len, tables))
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    req = torch.tensor(data.draw(st.lists(st.integers(0, len(tables) - 1), min_size=1, max_size=20)))
    pos = torch.tensor([data.draw(st.integers(0, len(tables[r]) * page_size - 1)) for r in req.tolist()])
    raw = write_locations(table, req, pos, page_size)
    expanded = write_locations(expand_block_table(table, factor), req, pos, page_size // factor)
    assert torch.equal(raw, expanded)


@given(tables=block_tables())
def test_drawn_block_tables_share_no_page(tables):
    """As every drawn batch: distinct non-null pages, none shared between requests or
    repeated within one."""
    pages = [p for table in tables for p in table]
    assert tables and all(tables) and len(pages) == len(set(pages)) and min(pages) >= 1


@given(tables=block_tables(max_requests=5, max_pages=4, max_page=6))
def test_drawn_block_tables_stop_where_the_pages_run_out(tables):
    pages = [p for table in tables for p in table]
    assert len(pages) == len(set(pages)) <= 6 and max(map(len, tables)) <= 4 and len(tables) <= 5


@given(case=decode_cases())
def test_decode_padding_rows_and_tails_resolve_to_null_page(case):
    meta = refresh_decode(case.rows, case.num_rows, case.max_pages, case.page_size)
    inv.check_padding_rows_null(meta, len(case.rows), case.page_size)
    inv.check_table_tails_null(meta, [r.pages for r in case.rows])
    inv.check_no_write_into_live_pages(meta, len(case.rows), [r.pages for r in case.rows], case.page_size)


@given(case=decode_cases())
def test_decode_live_rows_write_their_own_pages(case):
    meta = refresh_decode(case.rows, case.num_rows, case.max_pages, case.page_size)
    for i, row in enumerate(case.rows):
        slot = int(meta.slot_mapping[i])
        assert slot // case.page_size == row.pages[row.position // case.page_size]
        assert slot % case.page_size == row.position % case.page_size


@given(case=decode_cases())
def test_a_decode_step_samples_every_row_in_order(case):
    """What ``drop_sample_gather`` relies on: decode's gather of the sampled rows is the
    identity, padding rows included."""
    meta = refresh_decode(case.rows, case.num_rows, case.max_pages, case.page_size)
    assert torch.equal(meta.sample_rows, torch.arange(case.num_rows))


@given(case=decode_cases())
def test_eager_and_padded_refresh_agree_on_live_rows(case):
    eager = refresh_decode(case.rows, len(case.rows), case.max_pages, case.page_size)
    padded = refresh_decode(case.rows, case.num_rows, case.max_pages, case.page_size)
    inv.check_live_rows_equal(eager, padded, len(case.rows), DECODE_FIELDS)


@given(case=extend_cases())
def test_extend_padding_rows_resolve_to_null_page(case):
    live = sum(len(c.tokens) for c in case.chunks)
    meta = plan_extend(case.chunks, case.num_rows, len(case.chunks) + 1, case.max_pages, case.page_size)
    inv.check_padding_rows_null(meta, live, case.page_size)
    inv.check_no_write_into_live_pages(meta, live, [c.pages for c in case.chunks], case.page_size)
    inv.check_table_tails_null(meta, [c.pages for c in case.chunks])


def verify_rows(case, drafts=None, kept=None) -> list:
    """The batch's window rows, each request ``kept[i]`` tokens on (none by default) and
    its next window as long as its pages allow."""
    kept = kept or [0] * len(case.lengths)
    return [row for n, k, p, d in zip(case.lengths, kept, case.pages, drafts or case.drafts)
            for row in window_rows(7, n + k, p, d)]


@given(case=verify_cases())
def test_verify_padding_rows_and_tails_resolve_to_null_page(case):
    rows = verify_rows(case)
    meta = refresh_decode(rows, case.num_rows, case.max_pages, case.page_size)
    inv.check_padding_rows_null(meta, len(rows), case.page_size)
    inv.check_table_tails_null(meta, [r.pages for r in rows])
    inv.check_no_write_into_live_pages(meta, len(rows), case.pages, case.page_size)


@given(case=verify_cases(), data=st.data())
def test_rejected_drafts_keys_are_rewritten_before_any_row_reads_them(case, data):
    """A window keeps 1..width tokens; the keys its rejected rows wrote stay in the cache.
    In the next window every row reads the positions up to its own, and each of those
    that holds a rejected key is written again by a row of that window first (every row
    writes before any attends)."""
    def slot(pages, position):
        return pages[position // case.page_size] * case.page_size + position % case.page_size

    kept = [data.draw(st.integers(1, len(d) + 1)) for d in case.drafts]
    room = [len(p) * case.page_size - n - k for n, k, p in zip(case.lengths, kept, case.pages)]
    nexts = [tuple(data.draw(st.lists(st.integers(0, 999), max_size=r))) for r in room]
    before = refresh_decode(verify_rows(case), len(verify_rows(case)), case.max_pages, case.page_size)
    after_rows = verify_rows(case, nexts, kept)
    after = refresh_decode(after_rows, len(after_rows), case.max_pages, case.page_size)
    rejected = set(before.slot_mapping.tolist()) - \
        {slot(p, n - 1 + j) for n, k, p in zip(case.lengths, kept, case.pages) for j in range(k)}
    rewritten = set(after.slot_mapping.tolist())
    for row in after_rows:
        read = {slot(row.pages, q) for q in range(row.position + 1)}
        assert read & rejected <= rewritten, (row, sorted(read & rejected - rewritten))


@given(case=extend_cases(), width=st.integers(1, 4))
def test_decoder_view_keeps_sampled_rows(case, width):
    meta = plan_extend(case.chunks, case.num_rows, len(case.chunks) + 1, case.max_pages,
                       case.page_size, view_width=width)
    assert torch.equal(meta.view_rows[meta.view_sample_rows], meta.sample_rows)
    assert meta.sample_rows.numel() == sum(c.completes for c in case.chunks)


@given(case=extend_cases(), width=st.integers(1, 4))
def test_decoder_view_is_each_chunks_kept_rows_in_order(case, width):
    """The view ``plan_extend`` builds over arrays is ``kept_rows`` of each chunk (what the
    prefill runner counts to pick the view bucket): the last rows of each, in order."""
    meta = plan_extend(case.chunks, case.num_rows, len(case.chunks) + 1, case.max_pages,
                       case.page_size, view_width=width)
    want, end = [], 0
    for chunk in case.chunks:
        end += len(chunk.tokens)
        want += range(end - kept_rows(chunk, width), end)
    assert meta.view_rows[:meta.num_live_view_rows].tolist() == want and meta.num_live_view_rows == len(want)


@given(ops=st.lists(st.tuples(st.booleans(), st.integers(0, 6)), max_size=60),
       num_pages=st.integers(2, 24))
def test_allocator_never_hands_out_page_zero_or_a_page_twice(ops, num_pages):
    alloc, held = BlockAllocator(num_pages), []
    for allocate, n in ops:
        if allocate:
            free_before = alloc.num_free
            try:
                pages = alloc.allocate(n)
            except OutOfPages:
                assert alloc.num_free == free_before and n > free_before
                continue
            assert 0 not in pages
            assert not set(pages) & {p for h in held for p in h}
            held.append(pages)
        elif held:
            alloc.free(held.pop(n % len(held)))
    assert alloc.num_free + sum(map(len, held)) == num_pages - 1


def test_allocator_rejects_double_free():
    alloc = BlockAllocator(4)
    pages = alloc.allocate(2)
    alloc.free(pages)
    with pytest.raises(InternalError, match="not allocated"):
        alloc.free(pages)


@given(capacity=st.integers(1, 40), max_pages=st.integers(1, 64), data=st.data())
def test_a_publish_copies_every_byte_the_views_of_its_batch_read(capacity, max_pages, data):
    from tokenspeed.execution.slots import MetadataSlots
    slots = MetadataSlots(refresh_decode((), capacity, max_pages, 4), capacity, "cpu")
    rows = data.draw(st.integers(1, capacity))
    base, end = slots.device_bytes.data_ptr(), slots.used_bytes(rows)
    for name, view in slots.view(rows).items():
        last = view.data_ptr() - base + view.numel() * view.element_size()
        assert last <= end, f"{name} ends at byte {last}, the copy at {end}"
    if rows < capacity and max_pages > 2:  # the widest field (the table) is laid out last
        assert end < slots.used_bytes(capacity)


@given(case=decode_cases(max_batch=8), data=st.data())
def test_a_staged_publish_copies_the_batch_and_leaves_the_rest(case, data):
    from tokenspeed.execution.slots import MetadataSlots
    assume(len(case.rows) >= 2)
    capacity, shape = case.num_rows, (case.max_pages, case.page_size)
    slots = MetadataSlots(refresh_decode((), capacity, *shape), capacity, "cpu", staged=True)
    slots.publish(refresh_decode(case.rows, capacity, *shape))  # live rows past the small batch
    rows = data.draw(st.integers(1, len(case.rows) - 1))
    small = refresh_decode(case.rows[:rows], rows, *shape)
    end, before = slots.used_bytes(rows), slots.device_bytes.clone()
    view = slots.publish(small)
    for name in slots.fields:
        assert torch.equal(getattr(view, name), getattr(small, name)), name
    assert torch.equal(slots.device_bytes[end:], before[end:])  # the rest is not copied over


@given(case=decode_cases(max_batch=8), staged=st.booleans())
def test_a_staged_descriptor_reaches_the_device_only_when_sent(case, staged):
    """``stage`` is a publish's host part: the views the step before reads keep their
    values until ``send``, which gives what ``publish`` gives; restaging the descriptor
    published last sends nothing."""
    from tokenspeed.execution.slots import MetadataSlots
    capacity, shape = case.num_rows, (case.max_pages, case.page_size)
    slots = MetadataSlots(refresh_decode((), capacity, *shape), capacity, "cpu", staged=staged)
    before = slots.publish(refresh_decode((), capacity, *shape))
    meta = refresh_decode(case.rows, capacity, *shape)
    held = slots.device_bytes.clone()
    pending = slots.stage(meta)
    assert torch.equal(slots.device_bytes, held)
    view = slots.send(pending)
    for name in slots.fields:
        assert torch.equal(getattr(view, name), getattr(meta, name)), name
    assert slots.send(slots.stage(meta)) is view
    assert before is not view


def test_a_descriptor_staged_as_current_and_published_over_is_refused_at_send():
    from tokenspeed.execution.slots import MetadataSlots
    slots = MetadataSlots(refresh_decode((), 2, 4, 4), 2, "cpu", staged=True)
    last = refresh_decode((), 2, 4, 4)
    slots.publish(last)
    pending = slots.stage(last)
    slots.publish(refresh_decode((), 1, 4, 4))
    with pytest.raises(InternalError, match="published over before it was sent"):
        slots.send(pending)


def test_a_staging_staged_over_is_refused_and_an_abandoned_one_keeps_the_alternation():
    """Only the latest staging is sent; one never sent (a step abandoned) does not move the
    staging copies' turn, so the next one never writes the copy sent last."""
    from tokenspeed.execution.slots import MetadataSlots
    slots = MetadataSlots(refresh_decode((), 2, 4, 4), 2, "cpu", staged=True)
    slots.publish(refresh_decode((), 2, 4, 4))
    abandoned = slots.stage(refresh_decode((), 1, 4, 4))
    latest = slots.stage(refresh_decode((), 2, 4, 4))
    assert latest.turn == abandoned.turn
    with pytest.raises(InternalError, match="staged over"):
        slots.send(abandoned)
    slots.send(latest)
    assert slots.stage(refresh_decode((), 1, 4, 4)).turn != latest.turn
