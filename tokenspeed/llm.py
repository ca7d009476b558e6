"""``ts.LLM``: load, trace, lower and serve a model; ``generate`` over token-id prompts."""

import os
from collections.abc import Sequence
from pathlib import Path

import torch

from tokenspeed.backends.kernels.precompile import CompileWorkers
from tokenspeed.backends.paged import CacheGroupRouter
from tokenspeed.backends.support import CudaGraphSupport
from tokenspeed.ir.trace import trace
from tokenspeed.models.loader import load
from tokenspeed.runtime.engine import Engine
from tokenspeed.runtime.kv_pool import BlockAllocator, allocate_kv_cache
from tokenspeed.runtime.request import Request
from tokenspeed.runtime.scheduler import Scheduler
from tokenspeed.runtime.startup import build_runners
from tokenspeed.sampling_params import RequestOutput, SamplingParams

CPU_KV_BYTES = 2 << 30


class LLM:
    def __init__(self, model, device="cpu", dtype=None, page_size: int = 16, max_num_seqs: int = 64,
                 max_model_len: int | None = None, max_num_batched_tokens: int = 2048,
                 capture_sizes=None, enforce_eager: bool = False, num_kv_pages: int | None = None,
                 seed: int = 0, token_buckets=None, view_width: int = 1, backend=None,
                 overlap: bool = True, compile_workers: int | None = None):
        """``capture_sizes``: decode ladder (default 1, 2, 4, 8, 16.. by 8 up to
        min(max_num_seqs, 256)); ``token_buckets``: prefill token buckets; ``view_width``:
        rows per request the prefill decoder view keeps (W); ``enforce_eager``: no graphs;
        ``overlap``: prepare decode step n+1 while step n runs, so the host's work for a
        step hides behind the GPU (``overlap=False`` reads every step's tokens first);
        ``compile_workers``: processes that compile the Triton kernels before the captures
        (default: one per two CPU cores, at most 8; 0 compiles each on first launch)."""
        _positive(page_size=page_size, max_num_seqs=max_num_seqs,
                  max_num_batched_tokens=max_num_batched_tokens, view_width=view_width)
        compile_workers = _default_workers() if compile_workers is None else compile_workers
        if compile_workers < 0:
            raise ValueError(f"compile_workers={compile_workers}: must be >= 0")
        self.model = _as_model(model, dtype, device)
        self.config = config = self.model.config
        self.device = torch.device(device)
        self.max_model_len = config.max_position_embeddings if max_model_len is None else max_model_len
        if not 1 <= self.max_model_len <= config.max_position_embeddings:
            raise ValueError(f"max_model_len={self.max_model_len} must be in [1, the model's "
                             f"max_position_embeddings={config.max_position_embeddings}]")
        self.page_size, self.max_pages = page_size, -(-self.max_model_len // page_size)
        if num_kv_pages is not None and num_kv_pages < 2:
            raise ValueError(f"num_kv_pages={num_kv_pages}: must be >= 2 (page 0 is the null page)")
        self.num_pages = num_kv_pages or self._default_num_pages(max_num_seqs)
        self.kv_cache = allocate_kv_cache(config, self.num_pages, page_size,
                                          next(self.model.parameters()).dtype, self.device)
        self.backend = backend or CacheGroupRouter()
        self.support = CudaGraphSupport(False, False) if enforce_eager else self.backend.graph_support()
        graphs = self.support.decode_graph or self.support.prefill_graph
        graphs = graphs and self.device.type == "cuda"
        with CompileWorkers(compile_workers if graphs else 0) as workers:  # imports overlap tracing
            self.traced = trace(self.model)
            self.lowered = {"prefill": self.traced.lower("prefill"),
                            "decode": self.traced.lower("decode", decode_graph=self.support.decode_graph)}
            self.scheduler = Scheduler(BlockAllocator(self.num_pages), page_size, max_num_seqs,
                                       max_num_batched_tokens)
            self.prefill, self.decode, self.startup = build_runners(
                self, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                capture_sizes=capture_sizes, token_buckets=token_buckets, view_width=view_width,
                seed=seed, compile_workers=workers)
        self.engine = Engine(self.scheduler, self.prefill, self.decode, config.eos_token_ids,
                             self.max_model_len, overlap)
        self._next_id = 0

    def generate(self, prompts: Sequence[Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        params = _per_prompt(sampling_params or SamplingParams(), len(prompts))
        requests = [self._request(i, p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
        for request in requests:
            self.scheduler.add(request)
        try:
            with torch.inference_mode():
                while self.engine.has_work:
                    self.engine.step()
        except BaseException:
            self.engine.in_flight = None  # nothing of this call may leak into the next one
            self.scheduler.abort_all()
            raise
        return [r.to_output() for r in requests]

    def _request(self, index: int, prompt, params: SamplingParams) -> Request:
        """Validate one prompt; raises naming its index before any work starts."""
        prompt = tuple(int(t) for t in prompt)
        where = f"prompt {index}"
        if not prompt:
            raise ValueError(f"{where} is empty")
        bad = [t for t in prompt if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(f"{where}: token id {bad[0]} is outside the vocabulary [0, {self.config.vocab_size})")
        total = len(prompt) + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(f"{where}: {len(prompt)} prompt tokens + max_tokens={params.max_tokens} "
                             f"= {total} exceeds max_model_len={self.max_model_len}")
        if -(-total // self.page_size) > self.num_pages - 1:
            raise ValueError(f"{where}: needs {-(-total // self.page_size)} KV pages, the pool has "
                             f"{self.num_pages - 1}")
        self._next_id += 1
        return Request(self._next_id - 1, prompt, params)

    def _default_num_pages(self, max_num_seqs: int) -> int:
        wanted = max_num_seqs * self.max_pages + 1
        c = self.config
        page_bytes = 2 * c.num_layers * self.page_size * c.num_kv_heads * c.head_dim * \
            next(self.model.parameters()).element_size()
        budget = CPU_KV_BYTES if self.device.type == "cpu" else \
            int(torch.cuda.mem_get_info(self.device)[0] * 0.8)
        return max(2, min(wanted, budget // page_bytes))


def _as_model(model, dtype, device):
    if isinstance(model, (str, Path)):
        return load(model, dtype=dtype, device=device)
    if not hasattr(model, "config"):
        raise TypeError(f"expected a checkpoint path or a tokenspeed model, got {type(model).__name__}")
    return model.to(device=device, dtype=dtype).eval() if dtype else model.to(device).eval()


def _default_workers() -> int:
    """Half the cores stay with this process, which traces, lowers and captures meanwhile:
    on 16 cores of an H200 host 8 workers started the 1B shape cold in 14.3-14.6 s, 16 in
    16.4-17.5 s and 4 in 17.3 s (33 variants)."""
    return min(_usable_cores() // 2, 8)


def _usable_cores() -> int:
    """Cores this process may run on (its affinity and cgroup cpuset), not the machine's."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _per_prompt(params, n: int) -> list[SamplingParams]:
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"{len(params)} sampling params for {n} prompts")
    return params


def _positive(**values) -> None:
    for name, value in values.items():
        if value < 1:
            raise ValueError(f"{name}={value}: must be >= 1")
