"""``ts.LLM``: load -> trace -> lower -> compile -> an engine, and ``generate``."""

from collections.abc import Sequence
from pathlib import Path

import torch

from tokenspeed import stages
from tokenspeed.backends.kernels.precompile import CompileWorkers
from tokenspeed.backends.paged import PagedAttentionBackend
from tokenspeed.models.loader import load
from tokenspeed.runtime.compile_config import CompileConfig
from tokenspeed.runtime.engine import Engine
from tokenspeed.runtime.kv_pool import BlockAllocator
from tokenspeed.runtime.outputs import RequestOutput
from tokenspeed.runtime.sampling_params import SamplingParams
from tokenspeed.runtime.scheduler import Scheduler


class LLM:
    def __init__(self, model, device="cpu", dtype=None, *, enforce_eager: bool = False,
                 overlap: bool = True, backend=None, **compile_options):
        """``model``: a Hugging Face directory, a GGUF file or a tokenspeed model.
        ``compile_options``: any :class:`CompileConfig` field (``page_size``,
        ``max_num_seqs``, ``max_model_len``, ``max_num_batched_tokens``, ``num_kv_pages``,
        ``capture_sizes``, ``token_buckets``, ``view_width``, ``graphs``, ``seed``,
        ``compile_workers``). ``enforce_eager``: no graphs, as ``graphs=False``.
        ``overlap``: prepare decode step n+1 while step n runs, so the host's work for a
        step hides behind the GPU (``False`` reads every step's tokens first)."""
        if enforce_eager:
            if compile_options.get("graphs"):
                raise ValueError("enforce_eager=True and graphs=True contradict each other")
            compile_options["graphs"] = False
        config = CompileConfig(device=device, **compile_options)
        backend = backend or PagedAttentionBackend()
        wanted = config.graph_support(backend.graph_support())
        with CompileWorkers(config.workers_for(wanted)) as workers:  # imports overlap loading
            self.model = _as_model(model, dtype, config.device)
            self.traced = stages.trace(self.model)
            decode_graph = backend.graph_support().decode_graph
            self.compiled = stages.compile(self.traced.lower("prefill"),
                                           self.traced.lower("decode", decode_graph=decode_graph),
                                           config, backend, workers)
        self.engine = Engine(Scheduler(BlockAllocator(self.compiled.num_pages), config.page_size,
                                       config.max_num_seqs, config.max_num_batched_tokens),
                             self.compiled.prefill, self.compiled.decode, self.model.config,
                             self.compiled.limits.max_model_len, overlap)

    @property
    def config(self):
        return self.model.config

    def generate(self, prompts: Sequence[Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        params = _per_prompt(sampling_params or SamplingParams(), len(prompts))
        requests = [self.engine.request(i, p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
        return self.engine.run(requests)


def _as_model(model, dtype, device):
    if isinstance(model, (str, Path)):
        return load(model, dtype=dtype, device=device)
    if not hasattr(model, "config"):
        raise TypeError(f"expected a checkpoint path or a tokenspeed model, got {type(model).__name__}")
    return model.to(device=device, dtype=dtype).eval() if dtype else model.to(device).eval()


def _per_prompt(params, n: int) -> list[SamplingParams]:
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"{len(params)} sampling params for {n} prompts")
    return params
