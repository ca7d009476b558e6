"""Gumbel-max sampling over the vocabulary in two launches, for the captured decode step.

The torch route (upcast, scale, uniform noise, two logs, add, argmax) is about ten kernels,
each a pass over ``[rows, vocab]``; at batch 32 and a 150k vocabulary that is most of a
millisecond. Here each program scores one block of one row and keeps its best (value,
index); a second launch picks each row's best block. Scores follow
``tokenspeed.execution.sampler.gumbel_argmax_reference``: greedy rows (``top_k == 1``) take
the raw logit (so the result is argmax, first index on ties), the others
``logit / temperature + Gumbel noise``. The noise is Philox keyed by the row's seed and
its position (``seed + position * POSITION_KEY``), read on the device: a captured graph
draws fresh noise at every step with unchanged settings, and a request samples the same
tokens whatever else is in its batch.
"""

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from tokenspeed.backends.kernels import pdl
from tokenspeed.backends.kernels.blocks import next_power_of_2
from tokenspeed.errors import InternalError

MIN_TEMPERATURE = 1e-5
POSITION_KEY = 2654435761  # as tokenspeed.execution.sampler.POSITION_KEY
BLOCK = 4096


class ColumnWrite(NamedTuple):
    """Where sampled tokens go besides ``out``: ``column[seats[row]]`` (the token column,
    ``execution.token_column``; contiguous)."""
    column: torch.Tensor
    seats: torch.Tensor


@triton.jit
def _block_best_kernel(logits_ptr, temp_ptr, top_k_ptr, seed_ptr, pos_ptr, best_val_ptr,
                       best_idx_ptr, vocab, stride_row, num_blocks, MIN_T: tl.constexpr,
                       KEY: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl.start(USE_PDL)
    pdl.wait(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    cols = block * BLOCK + tl.arange(0, BLOCK)
    mask = cols < vocab
    x = tl.load(logits_ptr + row * stride_row + cols, mask=mask,
                other=float("-inf")).to(tl.float32)
    store_block_best(x, mask, cols, row, block, temp_ptr, top_k_ptr, seed_ptr, pos_ptr, best_val_ptr,
                     best_idx_ptr, num_blocks, MIN_T, KEY, BLOCK)


@triton.jit
def store_block_best(x, in_vocab, cols, row, block, temp_ptr, top_k_ptr, seed_ptr, pos_ptr,
                     best_val_ptr, best_idx_ptr, num_blocks, MIN_T: tl.constexpr,
                     KEY: tl.constexpr, BLOCK: tl.constexpr):
    """The best (score, index) of a block of a row's fp32 logits ``x`` (columns ``cols``):
    the raw logit for a greedy row, else the tempered logit plus the row's keyed Gumbel
    noise; stored for ``_row_best_kernel``. Shared with the masked draw. A greedy row's
    program branches past the noise: drawn for it and discarded, the Philox rounds and two
    logs an element made both launches 26.4 us instead of 6.6 at 32 rows of a 128k
    vocabulary (H100, docs/PERFORMANCE.md, 2026-12-07)."""
    if tl.load(top_k_ptr + row) == 1:
        score = x
    else:
        temperature = tl.maximum(tl.load(temp_ptr + row), MIN_T)
        key = tl.load(seed_ptr + row) + tl.load(pos_ptr + row).to(tl.int64) * KEY
        u = tl.rand(key, cols)
        u = tl.minimum(tl.maximum(u, 1e-10), 1.0 - 1e-7)
        score = tl.where(in_vocab, x / temperature - tl.log(-tl.log(u)), float("-inf"))
    best = tl.argmax(score, 0, tie_break_left=True)
    tl.store(best_val_ptr + row * num_blocks + block, tl.max(score, 0))
    tl.store(best_idx_ptr + row * num_blocks + block, block * BLOCK + best)


@triton.jit
def _row_best_kernel(best_val_ptr, best_idx_ptr, out_ptr, num_blocks, stride_out, col_ptr, seat_ptr,
                     BLOCKS: tl.constexpr, USE_PDL: tl.constexpr, COLUMN: tl.constexpr):
    """The row's token into ``out``; COLUMN: into its seat of the token column too."""
    pdl.start(USE_PDL)
    pdl.wait(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    b = tl.arange(0, BLOCKS)
    val = tl.load(best_val_ptr + row * num_blocks + b, mask=b < num_blocks,
                  other=float("-inf"))
    winner = tl.argmax(val, 0, tie_break_left=True)
    token = tl.load(best_idx_ptr + row * num_blocks + winner)
    tl.store(out_ptr + row * stride_out, token.to(tl.int64))
    if COLUMN:
        tl.store(col_ptr + tl.load(seat_ptr + row), token.to(col_ptr.dtype.element_ty))


def gumbel_argmax(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                  seeds: torch.Tensor, positions: torch.Tensor, out: torch.Tensor = None,
                  block: int = BLOCK, column: "ColumnWrite | None" = None) -> torch.Tensor:
    """One token per row of ``logits [rows, vocab]``; per-row ``temperature``, ``top_k``
    (1 means greedy; other values are not applied here), ``seeds`` (int64) and
    ``positions`` (which key the noise with the seeds). Writes the tokens into ``out``
    ([rows] int64, may be strided) when given; ``block`` (a power of two) is the
    vocabulary slice of one program. ``column``: each row's token goes to its seat of the
    token column as well, by the launch that picks it (the column's own write was a launch
    of its own)."""
    if logits.dim() != 2:
        raise InternalError(f"logits must be [rows, vocab]; got {tuple(logits.shape)}")
    rows, vocab = logits.shape
    per_row = [("temperature", temperature), ("top_k", top_k), ("seeds", seeds), ("positions", positions)]
    for name, t in per_row + ([] if column is None else [("seats", column.seats)]):
        if t.shape != (rows,):
            raise InternalError(f"{name} must be [{rows}]; got {tuple(t.shape)}")
    out = torch.empty(rows, dtype=torch.int64, device=logits.device) if out is None else out
    if rows == 0 or vocab == 0:
        return out
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    num_blocks = triton.cdiv(vocab, block)
    best_val = torch.empty((rows, num_blocks), dtype=torch.float32, device=logits.device)
    best_idx = torch.empty((rows, num_blocks), dtype=torch.int32, device=logits.device)
    launch = pdl.launch_options(logits.device)
    _block_best_kernel[(rows, num_blocks)](
        logits, temperature, top_k, seeds, positions, best_val, best_idx, vocab, logits.stride(0),
        num_blocks, MIN_T=MIN_TEMPERATURE, KEY=POSITION_KEY, BLOCK=block, num_warps=8, **launch)
    col, seats = column if column is not None else (out, positions)   # unread without a column
    _row_best_kernel[(rows,)](best_val, best_idx, out, num_blocks, out.stride(0), col, seats,
                              BLOCKS=next_power_of_2(num_blocks), num_warps=1, COLUMN=column is not None, **launch)
    return out
