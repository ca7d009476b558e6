"""The bitmask kernel against its torch reference: small odd shapes (a vocabulary not a
multiple of 32, blocks that split a word, rows whose mask allows everything, masks
narrower than the vocabulary), under the Triton interpreter on CPU and for real on a GPU.
The reference itself is checked against the bits one at a time."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hypothesis import given, settings, strategies as st  # noqa: E402
from sm90 import assert_compiles  # noqa: E402

from tokenspeed.backends.kernels import triton_bitmask, triton_sampling  # noqa: E402
from tokenspeed.structured.bitmask import (apply_token_bitmask_, apply_token_bitmask_reference,  # noqa: E402
                                           mask_words, pack_allowed, pack_bits, unpack_bits)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FEW = settings(max_examples=25, deadline=None, derandomize=True)


def random_mask(rows: int, words: int, free_rows: list[int], seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    mask = torch.randint(-2**31, 2**31 - 1, (rows, words), dtype=torch.int32, generator=generator)
    mask[free_rows] = -1
    return mask


@FEW
@given(rows=st.integers(1, 5), vocab=st.integers(1, 200), word_slack=st.integers(-2, 1),
       block=st.sampled_from([16, 32, 64, 128]), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       data=st.data())
def test_the_kernel_equals_the_reference(rows, vocab, word_slack, block, dtype, data):
    words = max(1, mask_words(vocab) + word_slack)
    free = data.draw(st.lists(st.integers(0, rows - 1), max_size=rows))
    mask = random_mask(rows, words, free, seed=vocab)
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(rows)).to(dtype)
    expected = apply_token_bitmask_reference(logits.clone(), mask)
    got = triton_bitmask.apply_token_bitmask(logits.clone().to(DEVICE), mask.to(DEVICE), block=block)
    assert torch.equal(got.cpu(), expected)
    covered = min(vocab, words * 32)   # a free row's mask allows every token its words cover
    for row in free:
        assert torch.equal(got[row, :covered].cpu(), logits[row, :covered])


@FEW
@given(rows=st.integers(1, 4), vocab=st.integers(1, 150), block=st.sampled_from([16, 64, 256]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), data=st.data())
def test_the_masked_draw_equals_masking_then_drawing(rows, vocab, block, dtype, data):
    """The Gumbel-max launches reading the mask give the tokens of the masked float32 copy
    drawn by ``triton_sampling``: greedy and tempered rows, free rows, seeds and positions;
    with a token column, the same tokens at the rows' seats and nothing else written."""
    free = data.draw(st.lists(st.integers(0, rows - 1), max_size=rows))
    mask = random_mask(rows, mask_words(vocab), free, seed=vocab + rows)
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(vocab)).to(dtype).to(DEVICE)
    greedy = data.draw(st.lists(st.booleans(), min_size=rows, max_size=rows))
    top_k = torch.tensor([1 if g else 0 for g in greedy], dtype=torch.int64, device=DEVICE)
    temperature = torch.tensor(data.draw(st.lists(st.sampled_from([0.5, 1.0, 2.0]), min_size=rows,
                                                  max_size=rows)), device=DEVICE)
    seeds = torch.arange(rows, dtype=torch.int64, device=DEVICE) * 7919 + vocab
    positions = torch.arange(rows, dtype=torch.int64, device=DEVICE) + 3
    masked = triton_bitmask.apply_token_bitmask(logits.float(), mask.to(DEVICE))
    expected = triton_sampling.gumbel_argmax(masked, temperature, top_k, seeds, positions, block=block)
    seats = torch.tensor(data.draw(st.permutations(range(rows + 3)))[:rows], dtype=torch.int64, device=DEVICE)
    column = torch.full((rows + 3,), -1, dtype=torch.int64, device=DEVICE)
    written = triton_sampling.ColumnWrite(column, seats) if data.draw(st.booleans()) else None
    got = triton_bitmask.masked_gumbel_argmax(logits, mask.to(DEVICE), temperature, top_k, seeds, positions,
                                              torch.empty(rows, dtype=torch.int64, device=DEVICE), block=block,
                                              column=written)
    assert torch.equal(got, expected)
    expected_column = torch.full_like(column, -1)
    if written is not None:
        expected_column[seats] = expected
    assert torch.equal(column, expected_column)


def test_a_mask_narrower_than_the_vocabulary_forbids_the_rest():
    logits = torch.zeros(1, 70)
    apply_token_bitmask_reference(logits, torch.full((1, 1), -1, dtype=torch.int32))
    assert torch.isinf(logits[0, 32:]).all() and (logits[0, :32] == 0).all()


@FEW
@given(vocab=st.integers(1, 100), data=st.data())
def test_packing_sets_exactly_the_allowed_bits(vocab, data):
    allowed = data.draw(st.sets(st.integers(0, vocab - 1)))
    row = pack_allowed(allowed, vocab)
    assert row.dtype == torch.int32 and row.shape == (mask_words(vocab),)
    assert set(unpack_bits(row, vocab).nonzero().flatten().tolist()) == allowed
    for token in range(vocab):   # llguidance's layout: bit t % 32 of word t // 32
        assert bool((int(row[token // 32]) >> (token % 32)) & 1) == (token in allowed)


def test_pack_and_unpack_are_inverse():
    bits = torch.rand(3, 96, generator=torch.Generator().manual_seed(0)) < 0.5
    assert torch.equal(unpack_bits(pack_bits(bits), 96), bits)


def test_mismatched_shapes_are_named():
    with pytest.raises(ValueError, match=r"logits must be \[rows, vocab\] and bitmask \[rows, words\]"):
        apply_token_bitmask_(torch.zeros(2, 40), torch.zeros(3, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match="bitmask must be int32; got torch.int64"):
        apply_token_bitmask_(torch.zeros(2, 40), torch.zeros(2, 2, dtype=torch.int64))


SM90 = """
from sm90 import compile_sm90
from tokenspeed.backends.kernels import triton_bitmask as b
for logits in ("*fp32", "*bf16", "*fp16"):
    kernel = compile_sm90(b._apply_bitmask_kernel, dict(logits_ptr=logits, mask_ptr="*i32", vocab="i32", words="i32",
                          stride_logits="i32", stride_mask="i32"), dict(BLOCK=4096, USE_PDL=True))
    assert "griddepcontrol.wait" in kernel.asm["ptx"], "the kernel waits for the step before"
draw = compile_sm90(b._masked_block_best_kernel, dict(
    logits_ptr="*bf16", mask_ptr="*i32", temp_ptr="*fp32", top_k_ptr="*i64", seed_ptr="*i64", pos_ptr="*i64",
    best_val_ptr="*fp32", best_idx_ptr="*i32", vocab="i32", words="i32", stride_row="i32", stride_mask="i32",
    num_blocks="i32"), dict(MIN_T=1e-5, KEY=b.POSITION_KEY, BLOCK=4096, USE_PDL=True), 8)
assert "griddepcontrol.wait" in draw.asm["ptx"], "the masked draw waits for the step before"
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="GPU tests compile for real")
def test_the_kernel_compiles_for_sm90():
    """As tests/test_kernel_compile.py does for the others: in a child, without the interpreter."""
    assert_compiles(["-c", SM90])
