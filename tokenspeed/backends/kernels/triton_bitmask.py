"""A packed token bitmask applied to a logits batch in place: a disallowed token's logit
becomes -inf.

Row r of ``bitmask [rows, words]`` (int32) holds one bit per token, token t at bit
``t % 32`` of word ``t // 32`` (llguidance's layout); a set bit allows the token. Each
program covers one block of one row; it reads the block's mask words and writes -inf
where a bit is clear, never reading the logits, so a row whose words are all set (a
request without a constraint) costs one read of its words. Tokens past the mask's last
word are disallowed. The torch reference is ``tokenspeed.structured.bitmask``'s.

``masked_gumbel_argmax`` is the draw of a step whose rows need nothing but their masks:
the mask read inside the first launch of ``triton_sampling.gumbel_argmax`` (the same
scores, the same Philox noise), so the rows' tokens are those of masking the logits and
drawing from them, without the float copy of the logits, the masking launch and the
tempering ops between (a dozen launches of host time at every constrained decode step).
"""

import torch
import triton
import triton.language as tl

from tokenspeed.backends.kernels import pdl
from tokenspeed.backends.kernels.blocks import next_power_of_2
from tokenspeed.backends.kernels.triton_sampling import (MIN_TEMPERATURE, POSITION_KEY, ColumnWrite,
                                                          _row_best_kernel, store_block_best)

BLOCK = 4096


@triton.jit
def _apply_bitmask_kernel(logits_ptr, mask_ptr, vocab, words, stride_logits, stride_mask,
                          BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl.start(USE_PDL)
    pdl.wait(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_vocab = cols < vocab
    word = tl.load(mask_ptr + row * stride_mask + cols // 32,
                   mask=in_vocab & (cols // 32 < words), other=0)
    allowed = (word >> (cols % 32)) & 1
    blocked = tl.full([BLOCK], float("-inf"), tl.float32)
    tl.store(logits_ptr + row * stride_logits + cols,
             blocked.to(logits_ptr.dtype.element_ty), mask=in_vocab & (allowed == 0))


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """Masks ``logits [rows, vocab]`` in place with ``bitmask [rows, words]`` (int32, on
    the logits' device) and returns it; ``block`` (a power of two) is the vocabulary slice
    of one program."""
    rows, vocab = logits.shape
    if logits.stride(-1) != 1 or bitmask.stride(-1) != 1:
        raise ValueError("logits and bitmask must be contiguous along the vocabulary")
    if rows == 0 or vocab == 0:
        return logits
    grid = (rows, triton.cdiv(vocab, block))
    _apply_bitmask_kernel[grid](logits, bitmask, vocab, bitmask.shape[1], logits.stride(0),
                                bitmask.stride(0), BLOCK=block, num_warps=4,
                                **pdl.launch_options(logits.device))
    return logits


@triton.jit
def _masked_block_best_kernel(logits_ptr, mask_ptr, temp_ptr, top_k_ptr, seed_ptr, pos_ptr, best_val_ptr,
                              best_idx_ptr, vocab, words, stride_row, stride_mask, num_blocks,
                              MIN_T: tl.constexpr, KEY: tl.constexpr, BLOCK: tl.constexpr,
                              USE_PDL: tl.constexpr):
    pdl.start(USE_PDL)
    pdl.wait(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    cols = block * BLOCK + tl.arange(0, BLOCK)
    in_vocab = cols < vocab
    word = tl.load(mask_ptr + row * stride_mask + cols // 32, mask=in_vocab & (cols // 32 < words), other=0)
    allowed = in_vocab & (((word >> (cols % 32)) & 1) == 1)
    x = tl.load(logits_ptr + row * stride_row + cols, mask=in_vocab, other=float("-inf")).to(tl.float32)
    x = tl.where(allowed, x, float("-inf"))
    store_block_best(x, in_vocab, cols, row, block, temp_ptr, top_k_ptr, seed_ptr, pos_ptr, best_val_ptr,
                     best_idx_ptr, num_blocks, MIN_T, KEY, BLOCK)


def masked_gumbel_argmax(logits: torch.Tensor, bitmask: torch.Tensor, temperature: torch.Tensor,
                         top_k: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
                         out: torch.Tensor, block: int = BLOCK, column: ColumnWrite | None = None) -> torch.Tensor:
    """``triton_sampling.gumbel_argmax`` of ``logits [rows, vocab]`` with the tokens
    ``bitmask [rows, words]`` (int32, on the logits' device) disallows at -inf; the tokens
    into ``out`` ([rows] int64, may be strided) and, given a ``column``, into each row's seat
    of the token column by the same launch (no ``index_copy_`` after it)."""
    rows, vocab = logits.shape
    if logits.stride(-1) != 1 or bitmask.stride(-1) != 1 or bitmask.shape[0] != rows:
        raise ValueError(f"logits [rows, vocab] and bitmask [rows, words] must be contiguous along the "
                         f"vocabulary; got {tuple(logits.shape)} and {tuple(bitmask.shape)}")
    if column is not None and column.seats.shape != (rows,):
        raise ValueError(f"seats must be [{rows}]; got {tuple(column.seats.shape)}")
    if rows == 0 or vocab == 0:
        return out
    num_blocks = triton.cdiv(vocab, block)
    best_val = torch.empty((rows, num_blocks), dtype=torch.float32, device=logits.device)
    best_idx = torch.empty((rows, num_blocks), dtype=torch.int32, device=logits.device)
    launch = pdl.launch_options(logits.device)
    _masked_block_best_kernel[(rows, num_blocks)](
        logits, bitmask, temperature, top_k, seeds, positions, best_val, best_idx, vocab, bitmask.shape[1],
        logits.stride(0), bitmask.stride(0), num_blocks, MIN_T=MIN_TEMPERATURE, KEY=POSITION_KEY, BLOCK=block,
        num_warps=8, **launch)
    col, seats = column if column is not None else (out, positions)   # unread without a column
    _row_best_kernel[(rows,)](best_val, best_idx, out, num_blocks, out.stride(0), col, seats,
                              BLOCKS=next_power_of_2(num_blocks), num_warps=1, COLUMN=column is not None, **launch)
    return out
