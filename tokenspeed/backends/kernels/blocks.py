"""Host-side block sizes for kernel launches."""


def next_power_of_2(n: int) -> int:
    """``triton.next_power_of_2`` (the least power of two >= n; 0 for 0) without Triton's
    constexpr-function wrapper, which costs ~4 us a call on the host: eager launches (every
    layer's attention in a prefill step) call it at each launch."""
    return 1 << (n - 1).bit_length() if n > 0 else 0
