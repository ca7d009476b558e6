"""``tokenspeed::decode_layer`` as the ops it fuses, run by one backend's kernels: the CPU's
reference, and CUDA's form where the one-launch kernel does not run (more rows than it
takes, a float8 cache)."""

from tokenspeed.backends.kernels.blocks import next_power_of_2


def decode_layer_by_ops(kernels, x, residual, input_norm, qkv_weight, o_weight, post_norm, gate_up_weight,
                        down_weight, eps, cos_sin, positions, kv_cache, layer, slot_mapping, block_tables,
                        row_request, scale, num_heads, num_kv_heads, split_counters=None):
    """``kernels``: a backend module (``reference``, ``cuda``) with the IR's ops."""
    head_dim = qkv_weight.shape[0] // (num_heads + 2 * num_kv_heads)
    qkv, *total = kernels.norm_linear(x, residual, input_norm, eps, qkv_weight, None, split_counters=split_counters)
    h = total[0] if total else x
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], -1)
    att = kernels.rope_decode_attention(q.view(-1, num_heads, head_dim), k.view(-1, num_kv_heads, head_dim),
                                        v.view(-1, num_kv_heads, head_dim), cos_sin, positions, kv_cache, layer,
                                        slot_mapping, block_tables, row_request, scale, 0)
    o = kernels.linear(att.view(-1, num_heads * head_dim), o_weight, None, split_counters=split_counters)
    gate_up, h = kernels.norm_linear(h, o, post_norm, eps, gate_up_weight, None, split_counters=split_counters)
    return [h, kernels.gated_linear(gate_up, down_weight, None, split_counters=split_counters)]


def layer_kernel_refuses(hidden: int, intermediate: int, num_heads: int, num_kv_heads: int,
                         head_dim: int) -> str | None:
    """Why ``triton_layer``'s tiles cannot hold a layer of this shape (None: they can). A
    program holds a tile of at least two QKV rows, a gate row and an up row, one down row,
    one output-projection row per head, and the attention's merged splits, each within 16K
    elements (eight warps' registers)."""
    if head_dim & (head_dim - 1) or not 16 <= head_dim <= 256:
        return f"head_dim {head_dim} (the kernel takes a power of two from 16 to 256)"
    if num_heads % num_kv_heads:
        return f"{num_heads} query heads over {num_kv_heads} KV heads"
    widest = {"hidden": 2 * next_power_of_2(hidden), "intermediate": next_power_of_2(intermediate),
              "heads x head_dim": 4 * next_power_of_2(num_heads) * head_dim}
    over = [name for name, width in widest.items() if width > 16384]
    return f"{', '.join(over)} past the kernel's tiles" if over else None
