"""The recurrent layers' state pools: beside the KV pool, a slot per running request
(its seat, ``execution/token_column.py``) and slot 0, the null slot padding rows use.

``conv [linear layers, slots, conv_dim, kernel]`` holds each request's last inputs to the
short convolution, in the model's dtype; ``recurrent [linear layers, slots, value heads,
key dim, value dim]`` its gated-delta-rule state, float32 whatever the model's dtype (as
transformers and fla keep it). They are buffers of the model, so every graph reads them by
address; a model holds the null slot alone until ``allocate`` sizes it for an engine
(``ts.LLM`` does, before tracing: the traced graphs read the pools that exist then).
"""

import torch
from torch import nn

from tokenspeed.models.hybrid_config import GatedDeltaNetConfig


class StatePools(nn.Module):
    def __init__(self, linear: GatedDeltaNetConfig, num_slots: int = 1):
        super().__init__()
        self.linear = linear
        self.register_buffer("conv", torch.zeros(self._conv_shape(num_slots)), persistent=False)
        self.register_buffer("recurrent", torch.zeros(self._recurrent_shape(num_slots)), persistent=False)

    @property
    def num_slots(self) -> int:
        return self.conv.shape[1]

    @property
    def slot_bytes(self) -> int:
        """One request's states in every linear layer."""
        return (self.conv[:, 0].numel() * self.conv.element_size() +
                self.recurrent[:, 0].numel() * self.recurrent.element_size())

    def allocate(self, num_slots: int) -> None:
        """Pools of ``num_slots`` slots (the null slot and one per sequence), zeroed, on the
        pools' device and in their dtypes: before a model is traced, never after."""
        self.conv = torch.zeros(self._conv_shape(num_slots), dtype=self.conv.dtype, device=self.conv.device)
        self.recurrent = torch.zeros(self._recurrent_shape(num_slots), dtype=torch.float32,
                                     device=self.recurrent.device)

    def copy_slots(self, copies) -> None:
        """Copy each (source slot, destination slot) pair's states, every linear layer's, in
        order on the device's stream (state checkpoints: ``scheduling/state_checkpoints.py``)."""
        for source, destination in copies:
            self.conv[:, destination].copy_(self.conv[:, source])
            self.recurrent[:, destination].copy_(self.recurrent[:, source])

    def _conv_shape(self, num_slots: int) -> tuple[int, ...]:
        return len(self.linear.layers), num_slots, self.linear.conv_dim, self.linear.conv_kernel

    def _recurrent_shape(self, num_slots: int) -> tuple[int, ...]:
        lin = self.linear
        return len(lin.layers), num_slots, lin.num_value_heads, lin.key_head_dim, lin.value_head_dim

    def _apply(self, fn, recurse=True):
        """A cast of the model (``model.to(bfloat16)``) leaves the recurrent state float32."""
        super()._apply(fn, recurse)
        if self.recurrent.dtype != torch.float32:
            self.recurrent = self.recurrent.float()
        return self
