"""A packed token bitmask applied to a logits batch in place: a disallowed token's logit
becomes -inf.

Row r of ``bitmask [rows, words]`` (int32) holds one bit per token, token t at bit
``t % 32`` of word ``t // 32`` (llguidance's layout); a set bit allows the token. Each
program covers one block of one row; it reads the block's mask words and writes -inf
where a bit is clear, never reading the logits, so a row whose words are all set (a
request without a constraint) costs one read of its words. Tokens past the mask's last
word are disallowed. The torch reference is ``tokenspeed.structured.bitmask``'s.
"""

import torch
import triton
import triton.language as tl

from tokenspeed.backends.kernels import pdl

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
