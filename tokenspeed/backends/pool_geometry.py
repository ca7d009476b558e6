"""What a KV pool must look like to the kernels of one cache group: every dimension but the
number of pages. A rebind may change how many pages a pool has, never this."""

import attrs
import torch


@attrs.frozen
class PoolGeometry:
    """``kv_cache[layer, part, page, offset, kv_head, head_dim]`` of ``dtype`` on ``device``:
    ``parts`` 2 (keys, values) or 1 (a latent-attention row, one head of latent + rope)."""
    num_layers: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device = attrs.field(converter=lambda d: _indexed(torch.device(d)))
    parts: int = 2

    @classmethod
    def of(cls, pool: torch.Tensor) -> "PoolGeometry":
        if pool.dim() != 6 or pool.shape[1] not in (1, 2):
            raise ValueError(f"a KV pool is [layers, 2 (or 1: latents), pages, page_size, kv_heads, head_dim]; "
                             f"got shape {tuple(pool.shape)}")
        layers, parts, _, page_size, kv_heads, head_dim = pool.shape
        return cls(layers, page_size, kv_heads, head_dim, pool.dtype, pool.device, parts)

    def shape(self, num_pages: int) -> torch.Size:
        return torch.Size((self.num_layers, self.parts, num_pages, self.page_size, self.num_kv_heads,
                           self.head_dim))

    @property
    def page_bytes(self) -> int:
        """Bytes of one page across every layer, keys and values (or latents)."""
        return self.shape(1).numel() * torch.empty((), dtype=self.dtype).element_size()

    def differences(self, other: "PoolGeometry") -> list[str]:
        """``field: ours != theirs`` for every field that differs."""
        return [f"{f.name} {getattr(other, f.name)} (expected {getattr(self, f.name)})"
                for f in attrs.fields(PoolGeometry) if getattr(self, f.name) != getattr(other, f.name)]


def _indexed(device: torch.device) -> torch.device:
    """``cuda`` as the device it means (``cuda:0``, the current one), as a tensor reports it."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device
