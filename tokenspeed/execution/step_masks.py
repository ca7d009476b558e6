"""A step's token masks: what its constrained rows may sample, applied to the logits before
the row's draw (``sampler.sample``), so the same keyed Gumbel-max picks the token.

The engine fills the host bitmask (``MaskFiller``: a grammar's mask ANDed with a row's
``allowed_token_ids``) into a pinned buffer of its own (``MaskBuffers``); the step copies
it to the device and masks the rows' logits (``apply_token_bitmask_``: the Triton kernel on
CUDA), then adds their ``logit_bias``. A step without a constrained row has no
``StepMasks``: no copy, no kernel.
"""

import attrs
import torch

from tokenspeed.structured import TokenBias, add_logit_bias_, apply_token_bitmask_, new_bitmask


@attrs.frozen(eq=False)   # holds a tensor: never compared
class StepMasks:
    """``bitmask``: the step's sampled rows' masks, ``[rows, words]`` host int32 (None: no row
    is masked, only biased); ``biases``: (row, its ``TokenBias``) for the rows with a
    ``logit_bias``."""
    bitmask: torch.Tensor | None
    biases: tuple[tuple[int, TokenBias], ...] = ()

    def applied(self, logits: torch.Tensor) -> torch.Tensor:
        """The rows' scores (float32, a copy: the logits stay the model's, for log-probabilities)
        with disallowed tokens at -inf and the biases added."""
        scores = logits.to(torch.float32, copy=True)
        if self.bitmask is not None:
            apply_token_bitmask_(scores, self.bitmask.to(scores.device, non_blocking=True))
        return add_logit_bias_(scores, self.biases)


class MaskBuffers:
    """Two host bitmasks taken in turn, pinned when the device is a GPU, so that a step's copy
    to the device may still be pending while the host fills the next step's. Each grows to
    the most rows a step has masked."""

    def __init__(self, vocab_size: int, pinned: bool):
        self.vocab_size, self.pinned = vocab_size, pinned
        self._buffers = [new_bitmask(0, vocab_size), new_bitmask(0, vocab_size)]
        self._turn = 0

    def take(self, rows: int) -> torch.Tensor:
        """A ``[rows, words]`` buffer (its contents are the filler's to write)."""
        self._turn ^= 1
        if self._buffers[self._turn].shape[0] < rows:
            self._buffers[self._turn] = new_bitmask(rows, self.vocab_size, pin_memory=self.pinned)
        return self._buffers[self._turn][:rows]
