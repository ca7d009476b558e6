"""A decode rung's masked draw, captured as one graph beside the rung's forward.

A step whose rows need nothing but their masks (``StepMasks.masks_only``) is drawn after
its forward: the masks copied to the device, the masked Gumbel-max's two launches, the
column written. Launched one by one that took about 0.17 ms of the host's time a step (the
default shape at batch 1, an H100's host), which left the host, not the device, bounding
a constrained step; captured, it is one replay (about 5 us). So each rung of the decode
ladder gets a draw graph at startup, over fixed addresses: the rung's logits (its forward
graph's output), its published settings and positions, the token column, and two mask
buffers of ``max_rows`` rows, a pinned host one the step's masks are copied into and the
device one the graph copies them to. The host buffer is written only once the last
replay's copy has read it (``staged_until``: the event its step's tokens wait on, which
the engine has always waited on already). The rows past a step's live ones draw from
whatever masks their rows hold, like the padded rows of the forward graph, into the
column's null seat.

Batches above the ladder, and steps with processed rows, draw eagerly (``StepMasks.draw``,
``sampler.sample``).
"""

import numpy as np
import torch

from tokenspeed.execution.step_masks import StepMasks
from tokenspeed.structured import new_bitmask


class MaskedDraws:
    def __init__(self, max_rows: int, device: torch.device):
        self.max_rows, self.device = max_rows, torch.device(device)
        self.graphs: dict[int, object] = {}   # rung -> Captured
        self._host = self._rows = None        # [max_rows, words], made for the first logits seen
        self._read = None                     # the event after the last replay's step

    def step(self, logits: torch.Tensor, settings, positions: torch.Tensor, out: torch.Tensor,
             column: torch.Tensor) -> None:
        """The draw of a rung of ``len(logits)`` rows from the staged masks (captured, and
        run eagerly by the dry run of the kernels' compile)."""
        rows = len(logits)
        host, device = self._buffers(logits.shape[1])
        device[:rows].copy_(host[:rows], non_blocking=True)
        StepMasks(device[:rows]).draw(logits, settings, positions, out, column)

    def capture(self, capturer, name: str, rung: int, fn, reach) -> None:
        """Rung ``rung``'s graph of ``fn`` (a call of ``step``); ``reach``: what the forward
        graph reads, to which the mask buffers are added for the pointer guard."""
        self.graphs[rung] = capturer.capture(name, fn, reach=lambda: {**reach(), "mask_host": self._host,
                                                                     "mask_rows": self._rows})

    def replay(self, rung: int | None, bitmask: torch.Tensor) -> bool:
        """Draw a step of rung ``rung`` (None: run eagerly) whose live rows' masks are
        ``bitmask [rows, words]`` (host int32); False, with nothing done, when the rung has
        no graph or the masks are not as wide as the logits' (the eager draw disallows the
        tokens past a narrower mask)."""
        graph = self.graphs.get(rung)
        if graph is None or bitmask.shape[1] != self._host.shape[1]:
            return False
        if self._read is not None:
            self._read.synchronize()
        np.copyto(self._host.numpy()[:len(bitmask)], bitmask.numpy())   # numpy: no torch thread pool
        graph.replay()
        return True

    def staged_until(self, event) -> None:
        """``event`` follows the last replay: the host buffer is free once it has passed."""
        self._read = event

    def _buffers(self, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._host is None:
            self._host = new_bitmask(self.max_rows, vocab_size, pin_memory=self.device.type == "cuda")
            self._rows = self._host.to(self.device)
        return self._host, self._rows
