"""Token-expert pairs grouped by expert into padded blocks, on the device, in three launches.

``triton_moe``'s products run one program per block of ``BLOCK_M`` rows, every row of a
block routed to the block's expert. Which pairs go where is computed here, as vLLM's and
SGLang's ``moe_align_block_size`` do in CUDA: the pairs are cut into chunks; one program
a chunk counts its pairs of each expert (``_count_kernel``); one program turns the counts
into each chunk's first row of each expert, pads each expert's rows to whole blocks, gives
each block its expert and marks every row empty (``_plan_kernel``); one program a chunk
then writes each pair at its expert's first row plus its rank among the expert's pairs
before it (``_place_kernel``). Pairs keep their order, so a block's rows keep token order.
Where the pairs are one chunk (a decode step of a few rows: 64 pairs of 128 experts, 8 rows
of Qwen3-30B-A3B; 128 of 64, 21 rows of DeepSeek-V2-Lite), one program does all three in
one launch (``_group_kernel``), reading the routing's int64 ids as they are: four launches
before, the ids' cast among them.

Nothing reaches the host and the shapes are fixed by T, k, E and BLOCK_M alone
(``max_blocks``): a step captured in a CUDA graph groups any routing. A chunk is a
``[pairs, experts]`` one-hot of ``ONE_HOT_ELEMENTS``, so the counting and placing spread
over as many programs as a prefill has chunks, and a decode step's few pairs are one.
"""

import attrs
import torch
import triton
import triton.language as tl

from tokenspeed.backends.kernels.blocks import next_power_of_2

ONE_HOT_ELEMENTS = 8192   # a chunk's [pairs, experts] one-hot: chunk rows = this / experts
FILL_ROWS = 1024          # empty rows marked a step


@attrs.frozen
class ExpertBlocks:
    """Token-expert pairs (``slot = t * k + j``) grouped by expert: ``slots[b * BLOCK_M + m]``
    is the pair in row m of block b (``T * k`` where the block's rows run out), and
    ``experts[b]`` its expert (E for a block past the last expert's)."""
    slots: torch.Tensor
    experts: torch.Tensor
    block_m: int


def max_blocks(pairs: int, num_experts: int, block_m: int) -> int:
    """Each expert with c pairs fills ceil(c / BLOCK_M) blocks, at most c / BLOCK_M + 1, and at
    most min(E, pairs) experts have any: the bound the grid is launched with."""
    return -(-pairs // block_m) + min(num_experts, pairs)


@triton.jit
def _one_hot(ids_ptr, pairs, CHUNK: tl.constexpr, E: tl.constexpr):
    """This program's chunk of pairs as ``[CHUNK, E]`` int32 (a pair past the last: zeros)."""
    p = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + p, mask=p < pairs, other=-1)
    return p, (ids[:, None] == tl.arange(0, E)[None, :]).to(tl.int32)


@triton.jit
def _count_kernel(ids_ptr, counts_ptr, pairs, CHUNK: tl.constexpr, E: tl.constexpr):
    _, one_hot = _one_hot(ids_ptr, pairs, CHUNK, E)
    tl.store(counts_ptr + tl.program_id(0) * E + tl.arange(0, E), tl.sum(one_hot, axis=0))


@triton.jit
def _plan_kernel(counts_ptr, starts_ptr, slots_ptr, block_experts_ptr, pairs, chunks, num_blocks,
                 num_experts, BLOCK_M: tl.constexpr, TILE: tl.constexpr, E: tl.constexpr,
                 FILL: tl.constexpr):
    """``counts[c]`` becomes chunk c's pairs of each expert before it; ``starts`` each
    expert's first row; ``E``: the experts rounded up to a power of two (lanes of none)."""
    experts = tl.arange(0, E)
    total = tl.zeros((E,), dtype=tl.int32)
    for first in range(0, chunks, TILE):
        c = first + tl.arange(0, TILE)
        at = counts_ptr + c[:, None] * E + experts[None, :]
        tile = tl.load(at, mask=c[:, None] < chunks, other=0)
        tl.store(at, tl.cumsum(tile, axis=0) - tile + total[None, :], mask=c[:, None] < chunks)
        total += tl.sum(tile, axis=0)
    starts = _blocks_of(total, slots_ptr, block_experts_ptr, pairs, num_blocks, num_experts, BLOCK_M, TILE, FILL)
    tl.store(starts_ptr + experts, starts)


@triton.jit
def _group_kernel(ids_ptr, slots_ptr, block_experts_ptr, pairs, num_blocks, num_experts, CHUNK: tl.constexpr,
                  E: tl.constexpr, BLOCK_M: tl.constexpr, TILE: tl.constexpr, FILL: tl.constexpr):
    """Count, plan and place for pairs that make one chunk, in one program."""
    p, one_hot = _one_hot(ids_ptr, pairs, CHUNK, E)
    starts = _blocks_of(tl.sum(one_hot, axis=0), slots_ptr, block_experts_ptr, pairs, num_blocks, num_experts,
                        BLOCK_M, TILE, FILL)
    tl.debug_barrier()   # every row marked empty before the pairs are placed over some of them
    row = tl.sum(one_hot * (tl.cumsum(one_hot, axis=0) - one_hot + starts[None, :]), axis=1)
    tl.store(slots_ptr + row, p, mask=p < pairs)


@triton.jit
def _blocks_of(total, slots_ptr, block_experts_ptr, pairs, num_blocks, num_experts, BLOCK_M: tl.constexpr,
               TILE: tl.constexpr, FILL: tl.constexpr):
    """From each expert's pair count: every row marked empty, each block's expert; returns
    each expert's first row."""
    padded = (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    for first in range(0, num_blocks * BLOCK_M, FILL):
        rows = first + tl.arange(0, FILL)
        tl.store(slots_ptr + rows, pairs, mask=rows < num_blocks * BLOCK_M)
    for first in range(0, num_blocks, TILE):
        block = first + tl.arange(0, TILE)
        owner = tl.sum((ends[None, :] <= block[:, None] * BLOCK_M).to(tl.int32), axis=1)
        tl.store(block_experts_ptr + block, tl.minimum(owner, num_experts), mask=block < num_blocks)
    return ends - padded


@triton.jit
def _place_kernel(ids_ptr, counts_ptr, starts_ptr, slots_ptr, pairs, CHUNK: tl.constexpr, E: tl.constexpr):
    p, one_hot = _one_hot(ids_ptr, pairs, CHUNK, E)
    experts = tl.arange(0, E)
    first = tl.load(starts_ptr + experts) + tl.load(counts_ptr + tl.program_id(0) * E + experts)
    row = tl.sum(one_hot * (tl.cumsum(one_hot, axis=0) - one_hot + first[None, :]), axis=1)
    tl.store(slots_ptr + row, p, mask=p < pairs)


def expert_blocks(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertBlocks:
    ids = topk_ids.reshape(-1)
    pairs, width = ids.numel(), max(16, next_power_of_2(num_experts))
    blocks, chunk = max_blocks(pairs, num_experts, block_m), max(16, ONE_HOT_ELEMENTS // width)
    chunks = triton.cdiv(pairs, chunk)
    slots = torch.empty(blocks * block_m, dtype=torch.int32, device=ids.device)
    block_experts = torch.empty(blocks, dtype=torch.int32, device=ids.device)
    tile = max(1, ONE_HOT_ELEMENTS // width)
    if chunks <= 1:
        _group_kernel[(1,)](ids, slots, block_experts, pairs, blocks, num_experts, CHUNK=max(16, next_power_of_2(
            pairs)), E=width, BLOCK_M=block_m, TILE=tile, FILL=FILL_ROWS)
        return ExpertBlocks(slots, block_experts, block_m)
    ids = ids.to(torch.int32)
    counts = torch.empty((chunks, width), dtype=torch.int32, device=ids.device)
    starts = torch.empty(width, dtype=torch.int32, device=ids.device)
    _count_kernel[(chunks,)](ids, counts, pairs, CHUNK=chunk, E=width)
    _plan_kernel[(1,)](counts, starts, slots, block_experts, pairs, chunks, blocks, num_experts, BLOCK_M=block_m,
                       TILE=tile, E=width, FILL=FILL_ROWS)
    _place_kernel[(chunks,)](ids, counts, starts, slots, pairs, CHUNK=chunk, E=width)
    return ExpertBlocks(slots, block_experts, block_m)
