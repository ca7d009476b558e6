"""Token-expert pairs grouped by expert into padded blocks, on the device, in one launch.

``triton_moe``'s products run one program per block of ``BLOCK_M`` rows, every row of a
block routed to the block's expert. Which pairs go where is computed here by one
program (vLLM's and SGLang's ``moe_align_block_size`` do it in CUDA): it counts each
expert's pairs, pads each count to whole blocks, gives each block its expert, and writes
each pair into its expert's rows at its rank among them (pairs in order, so a block's rows
keep token order). Nothing reaches the host and the shapes are fixed by T, k, E and
BLOCK_M alone (``max_blocks``): a step captured in a CUDA graph groups any routing. One
program, not a grid: a decode step's few pairs take one pass of one chunk, and a
prefill's are a few hundred chunks, small beside the expert products it feeds; several
launches of torch ops would cost more than the whole kernel for decode.
"""

import attrs
import torch
import triton
import triton.language as tl

from tokenspeed.backends.kernels.blocks import next_power_of_2

ONE_HOT_ELEMENTS = 8192   # a chunk's [pairs, experts] one-hot: chunk rows = this / experts


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
def _counts(ids_ptr, pairs, experts, CHUNK: tl.constexpr, E: tl.constexpr):
    counts = tl.zeros((E,), dtype=tl.int32)
    for start in range(0, pairs, CHUNK):
        p = start + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + p, mask=p < pairs, other=-1)
        counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
    return counts


@triton.jit
def _align_kernel(ids_ptr, slots_ptr, block_experts_ptr, pairs, num_blocks, num_experts,
                  BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, E: tl.constexpr):
    """``E``: the experts rounded up to a power of two (the extra lanes count nothing)."""
    experts = tl.arange(0, E)
    padded = (_counts(ids_ptr, pairs, experts, CHUNK, E) + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    for start in range(0, num_blocks * BLOCK_M, CHUNK):
        rows = start + tl.arange(0, CHUNK)
        tl.store(slots_ptr + rows, pairs, mask=rows < num_blocks * BLOCK_M)
    for start in range(0, num_blocks, CHUNK):
        block = start + tl.arange(0, CHUNK)
        owner = tl.sum((ends[None, :] <= block[:, None] * BLOCK_M).to(tl.int32), axis=1)
        tl.store(block_experts_ptr + block, tl.minimum(owner, num_experts), mask=block < num_blocks)
    tl.debug_barrier()   # every padding row written before the pairs overwrite theirs
    seen = tl.zeros((E,), dtype=tl.int32)
    for start in range(0, pairs, CHUNK):
        p = start + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + p, mask=p < pairs, other=-1)
        one_hot = (ids[:, None] == experts[None, :]).to(tl.int32)
        before = tl.cumsum(one_hot, axis=0) - one_hot + seen[None, :]
        row = tl.sum(one_hot * (before + (ends - padded)[None, :]), axis=1)
        tl.store(slots_ptr + row, p, mask=p < pairs)
        seen += tl.sum(one_hot, axis=0)


def expert_blocks(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertBlocks:
    ids = topk_ids.reshape(-1).to(torch.int32)
    pairs = ids.numel()
    blocks = max_blocks(pairs, num_experts, block_m)
    slots = torch.empty(blocks * block_m, dtype=torch.int32, device=ids.device)
    block_experts = torch.empty(blocks, dtype=torch.int32, device=ids.device)
    width = max(16, next_power_of_2(num_experts))
    _align_kernel[(1,)](ids, slots, block_experts, pairs, blocks, num_experts, BLOCK_M=block_m,
                        CHUNK=max(16, ONE_HOT_ELEMENTS // width), E=width)
    return ExpertBlocks(slots, block_experts, block_m)
