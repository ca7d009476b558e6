"""A step's token masks: what its constrained rows may sample, applied to the logits before
the row's draw (``sampler.sample``), so the same keyed Gumbel-max picks the token.

The engine fills the host bitmask (``MaskFiller``: a grammar's mask ANDed with a row's
``allowed_token_ids``) into a pinned buffer of its own (``MaskBuffers``); the step copies
it to the device and masks the rows' logits (``apply_token_bitmask_``: the Triton kernel on
CUDA), then adds their ``logit_bias`` (as ``add_logit_bias_`` adds it). A step without a constrained row has no
``StepMasks``: no copy, no kernel.
"""

import attrs
import torch

from tokenspeed.execution.host_to_device import values_on
from tokenspeed.structured import TokenBias, apply_token_bitmask_, new_bitmask


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
        return self._biased(scores) if self.biases else scores

    @property
    def masks_only(self) -> bool:
        """No row is biased: a step whose rows need no other processing draws with ``draw``."""
        return self.bitmask is not None and not self.biases

    def draw(self, logits: torch.Tensor, settings, positions: torch.Tensor, out: torch.Tensor,
             column: torch.Tensor | None = None) -> torch.Tensor:
        """The rows' tokens into ``out`` (and into their seats, ``settings.seat``, of the token
        ``column`` if given), as ``sampler.sample`` draws them when the masks are all there is
        to a step's processing (``masks_only``): on CUDA in the Gumbel-max launches themselves
        (``triton_bitmask.masked_gumbel_argmax``), without the masked copy of the logits, the
        column written by the launch that picks the tokens."""
        bitmask = self.bitmask.to(logits.device, non_blocking=True)
        if logits.is_cuda:
            from tokenspeed.backends.kernels import triton_bitmask, triton_sampling
            written = None if column is None else triton_sampling.ColumnWrite(column, settings.seat)
            return triton_bitmask.masked_gumbel_argmax(logits, bitmask, settings.temperature, settings.top_k,
                                                       settings.seed, positions, out, column=written)
        from tokenspeed.execution.sampler import gumbel_argmax
        scores = logits.to(torch.float32, copy=True)   # the logits stay the model's
        return gumbel_argmax(apply_token_bitmask_(scores, bitmask), settings, positions, out, column)

    def _biased(self, scores: torch.Tensor) -> torch.Tensor:
        """``add_logit_bias_``'s sum, its indices copied as the step's other settings are
        (``values_on``: a copy from pageable memory would wait for the forward in flight)."""
        pairs = [(row, token, value) for row, bias in self.biases for token, value in bias.logit_bias]
        rows, tokens = values_on([[p[0] for p in pairs], [p[1] for p in pairs]], torch.int64, scores.device)
        values = values_on([p[2] for p in pairs], torch.float32, scores.device)
        return scores.index_put_((rows, tokens), values, accumulate=True)


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
