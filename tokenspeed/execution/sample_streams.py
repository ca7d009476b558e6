"""Each sample's noise stream, from its request's seed and its index among the ``n``.

A sample's noise is keyed by one signed 64-bit number (its positions move the key on:
``sampler.noise_keys``). Keying sample ``i`` of ``seed`` by ``seed + i`` made the samples of
neighbouring seeds overlap (``seed=77, n=2``'s second sample was ``seed=78``'s first), and
folding seeds into fewer bits aliased distinct seeds. Here the key is a bijective 64-bit
mix of the seed, moved by the index and mixed again: for one index, every signed 64-bit
seed gets its own key, and keys of other indices land far from it, with no structure a
neighbouring seed could share.
"""

MASK64 = 2**64 - 1
INDEX_STEP = 0x9E3779B97F4A7C15   # odd (2**64 / golden ratio): indices spread over the keys


def mix64(value: int) -> int:
    """SplitMix64's finaliser: a bijection of the 64-bit integers that scatters neighbours."""
    z = value & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def stream_key(seed: int, index: int) -> int:
    """The noise key of sample ``index`` of a request seeded ``seed`` (a signed 64-bit
    integer), as the signed 64-bit integer the sampler's tensors hold."""
    key = mix64(mix64(seed) + index * INDEX_STEP)
    return key - 2**64 if key >= 2**63 else key
