"""How a lowered model is compiled: its KV pool, batch limits, ladders and graphs.

``CompileConfig`` is what a user asks for; ``EngineLimits`` is what it comes to for one
model (its context length bounds ``max_model_len``, which sets the block-table width).
"""

import numbers

import attrs
import torch

from tokenspeed.backends.support import CudaGraphSupport
from tokenspeed.cores import allowed_cpus
from tokenspeed.execution.ladders import MAX_NUM_SEQS, as_sizes, given_ladder, is_integer

MAX_COMPILE_WORKERS = 8
KV_CACHE_DTYPES = {"auto": None, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}
FP8_CAPABILITY = (8, 9)   # the first CUDA devices with float8 conversions (Ada)
CPU_CHUNK_TOKENS = 256   # a prompt's new tokens per step on the CPU (docs/PERFORMANCE.md)


def integer_in(minimum: int | None, maximum: int | None = None, optional: bool = False):
    """An integer (not a bool) in [minimum, maximum] (None: unbounded); None only where
    ``optional``."""
    bounds = "" if minimum is None else f" >= {minimum}" if maximum is None else f" in [{minimum}, {maximum}]"

    def check(instance, attribute, value):
        if value is None and optional:
            return
        if not is_integer(value):
            raise TypeError(f"{attribute.name}={value!r}: must be an integer{bounds}")
        if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
            raise ValueError(f"{attribute.name}={value}: must be{bounds}")
    return check


def _share(instance, attribute, value):
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{attribute.name}={value!r}: must be a number in (0, 1]")
    if not 0 < value <= 1:
        raise ValueError(f"{attribute.name}={value}: must be in (0, 1]")


def _optional_bool(instance, attribute, value):
    if value is not None and not isinstance(value, bool):
        raise TypeError(f"{attribute.name}={value!r}: must be True, False or None")


def _within_step(instance, attribute, value):
    if value is not None and not 1 <= value <= instance.max_num_batched_tokens:
        raise ValueError(f"{attribute.name}={value}: must be in [1, max_num_batched_tokens="
                         f"{instance.max_num_batched_tokens}]")


def _kv_cache_dtype(instance, attribute, value):
    if value not in KV_CACHE_DTYPES:
        raise ValueError(f"{attribute.name}={value!r}: expected one of {', '.join(KV_CACHE_DTYPES)}")


def _sizes_up_to(limit: str):
    """A ladder (``given_ladder``) for steps of at most ``limit`` rows, a field before it:
    a size above the limit pads a full step, so one may be given, under twice the limit;
    a graph of more rows would never run, or pad a step to more than twice its rows."""
    def check(instance, attribute, value):
        if value is None:
            return
        most = getattr(instance, limit)
        above = [size for size in given_ladder(attribute.name, value) if size > most]
        if len(above) > 1 or (above and above[0] >= 2 * most):
            raise ValueError(f"{attribute.name}={list(value)}: a step holds at most {limit}={most} rows; "
                             f"one size above it may pad a full step, under {2 * most}")
    return check


def _one_pool_size(instance, attribute, value):
    if value is not None and instance.num_kv_pages is not None:
        raise ValueError(f"num_kv_pages={instance.num_kv_pages} and kv_cache_memory_bytes={value} both size "
                         f"the KV pool: give one")


def as_device(device) -> torch.device:
    """``device`` as a ``torch.device``, or a ``ValueError`` naming it."""
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device={device!r} is not a device (cpu, cuda, cuda:N)") from exc


@attrs.frozen
class CompileConfig:
    """``max_num_seqs``: requests running at once (at most ``MAX_NUM_SEQS``: their seats'
    buffers are sized up front); ``capture_sizes``: decode ladder (default 1, 2, 4, 8, 16..
    by 8 up to min(max_num_seqs, 256); past max_num_seqs, one size under twice it);
    ``token_buckets``: prefill token buckets (likewise for max_num_batched_tokens); ``view_width``: rows
    per request the prefill decoder view keeps (W); ``graphs``: capture graphs (default:
    on a CUDA device; ``True`` on the CPU captures the CPU stand-in, for tests);
    ``num_kv_pages``: the pool's pages, page 0 included; or ``kv_cache_memory_bytes``, the
    pool's bytes (not both); else ``gpu_memory_utilization``, the share of a GPU's memory
    the engine fills, everything included (default 0.9; on the CPU the pool gets 512 MiB); no pool
    exceeds ``max_num_seqs`` sequences at full length (``execution.kv_pool``; a request of a
    model windowed on every layer holds only its window's pages); ``compile_workers``:
    processes that compile the Triton kernels before the captures (default: half the usable
    cores, at most 8; 0 compiles each on first launch); ``max_chunk_tokens``: the most new
    tokens a step computes for one request (``chunk_tokens``); ``kv_cache_dtype``: what the
    KV pool stores, ``"auto"`` the model's dtype, ``"fp8_e4m3"`` (or ``"fp8"``) float8 e4m3
    through each layer's scales (``models.kv_scales``), half the bytes of 16-bit values per
    token, so twice the pages fit in a budget."""
    device: torch.device = attrs.field(default="cpu", converter=as_device)
    page_size: int = attrs.field(default=16, validator=integer_in(1))
    max_num_seqs: int = attrs.field(default=64, validator=integer_in(1, MAX_NUM_SEQS))
    max_model_len: int | None = attrs.field(default=None, validator=integer_in(1, optional=True))
    max_num_batched_tokens: int = attrs.field(default=2048, validator=integer_in(1))
    max_chunk_tokens: int | None = attrs.field(default=None, validator=[integer_in(1, optional=True), _within_step])
    num_kv_pages: int | None = attrs.field(default=None, validator=integer_in(2, optional=True))
    kv_cache_memory_bytes: int | None = attrs.field(default=None,
                                                    validator=[integer_in(1, optional=True), _one_pool_size])
    gpu_memory_utilization: float = attrs.field(default=0.9, validator=_share)
    capture_sizes: tuple[int, ...] | None = attrs.field(
        default=None, converter=attrs.converters.optional(as_sizes), validator=_sizes_up_to("max_num_seqs"))
    token_buckets: tuple[int, ...] | None = attrs.field(
        default=None, converter=attrs.converters.optional(as_sizes),
        validator=_sizes_up_to("max_num_batched_tokens"))
    view_width: int = attrs.field(default=1, validator=integer_in(1))
    graphs: bool | None = attrs.field(default=None, validator=_optional_bool)
    seed: int = attrs.field(default=0, validator=integer_in(None))
    compile_workers: int | None = attrs.field(default=None, validator=integer_in(0, optional=True))
    kv_cache_dtype: str = attrs.field(default="auto", validator=_kv_cache_dtype)

    def graph_support(self, backend_support: CudaGraphSupport) -> CudaGraphSupport:
        """What gets captured: the backend's support, where graphs are wanted at all."""
        wanted = self.device.type == "cuda" if self.graphs is None else self.graphs
        return backend_support if wanted else CudaGraphSupport(False, False, False)

    def kv_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The KV pool's dtype for a model whose activations are ``model_dtype``; float8 on
        a GPU that converts to it (compute capability 8.9 on: Ada, Hopper and later)."""
        dtype = KV_CACHE_DTYPES[self.kv_cache_dtype]
        if dtype is not None and self.device.type == "cuda":
            capability = torch.cuda.get_device_capability(self.device)
            if capability < FP8_CAPABILITY:
                raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r}: float8 needs a GPU of compute "
                                 f"capability {'.'.join(map(str, FP8_CAPABILITY))} or later; "
                                 f"{self.device} has {'.'.join(map(str, capability))}")
        return dtype or model_dtype

    def chunk_tokens(self) -> int:
        """``max_chunk_tokens``, by default the whole step's budget, but on the CPU
        ``CPU_CHUNK_TOKENS``: a CPU step costs about a second per 256 new tokens of a small
        model, so a long prompt taking the whole budget would hold every other request back
        for as long as its prefill runs; in chunks, a request that arrives meanwhile joins
        the next step (as vLLM's chunked prefill does with its long-prefill threshold)."""
        if self.max_chunk_tokens is not None:
            return self.max_chunk_tokens
        wanted = CPU_CHUNK_TOKENS if self.device.type == "cpu" else self.max_num_batched_tokens
        return min(wanted, self.max_num_batched_tokens)

    def workers_for(self, support: CudaGraphSupport) -> int:
        """Compile workers to start: none without CUDA graphs (nothing compiles ahead)."""
        captures = support.decode_graph or support.prefill_graph
        if not captures or self.device.type != "cuda":
            return 0
        return default_workers() if self.compile_workers is None else self.compile_workers

    def resolve(self, model_config) -> "EngineLimits":
        longest = model_config.max_position_embeddings
        max_model_len = longest if self.max_model_len is None else self.max_model_len
        if max_model_len > longest:
            raise ValueError(f"max_model_len={max_model_len} must be in [1, the model's "
                             f"max_position_embeddings={longest}]")
        return EngineLimits(max_model_len, -(-max_model_len // self.page_size))


@attrs.frozen
class EngineLimits:
    max_model_len: int
    max_pages: int           # block-table width: pages of the longest request


def default_workers() -> int:
    """Half the usable cores, at most 8: the other half stays with this process, which
    traces, lowers and captures meanwhile (docs/PERFORMANCE.md, startup)."""
    return min(allowed_cpus() // 2, MAX_COMPILE_WORKERS)
