"""The pipeline in one place: ``trace -> lower -> compile``, each stage an object that
prints and that the next stage builds from (as JAX's ``jit(f).lower(x).compile()``);
``Traced`` and ``Lowered`` are immutable, ``Compiled`` holds the runners' live state.

    traced = ts.trace(model)                                  # Traced: the FX graph
    prefill, decode = traced.lower("prefill"), traced.lower("decode")   # Lowered
    compiled = ts.compile(prefill, decode, ts.CompileConfig(device="cuda"))
    compiled.decode.run(rows, params)                         # Compiled: runs a batch

One compile takes both lowered modes: their runners share one KV pool, one graph memory
pool and one startup (kernel compiles, then captures).
"""

import gc
import inspect
import time

import attrs
import networkx as nx
import torch
from torch import fx

from tokenspeed.backends.kernels.precompile import CompileWorkers
from tokenspeed.backends.mla import backend_for
from tokenspeed.backends.pool_geometry import PoolGeometry
from tokenspeed.backends.support import CudaGraphSupport, walk
from tokenspeed.ir.descriptors import ForwardMetadata
from tokenspeed.ir.printing import graph_text
from tokenspeed.ir.program import STAGES, Program, Segment
from tokenspeed.ir.trace import input_names, trace_graph
from tokenspeed.passes.manager import HistoryEntry
from tokenspeed.passes.pipeline import run_pipeline
from tokenspeed.execution.compile_config import CompileConfig, EngineLimits
from tokenspeed.execution.decode_runner import DecodeRunner
from tokenspeed.execution import kv_pool
from tokenspeed.scheduling.prompt_limits import most_pages_held
from tokenspeed.execution.prefill_runner import PrefillRunner
from tokenspeed.execution.startup import StartupReport, build_runners
from tokenspeed import stage_checks


def trace(model: torch.nn.Module) -> "Traced":
    """Trace ``model.forward(kv_cache, meta)`` with ``meta`` a :class:`ForwardMetadata`."""
    if isinstance(model, (Traced, fx.GraphModule)):   # a traced graph's class is also named Traced
        what = "a Traced" if isinstance(model, Traced) else "a torch.fx.GraphModule (a Traced's graph_module?)"
        raise TypeError(f"trace(model): got {what}, which is traced already: lower the Traced "
                        f"(traced.lower('prefill')), or trace the model it came from")
    forward = getattr(model, "forward", None) if isinstance(model, torch.nn.Module) else None
    if forward is None or list(inspect.signature(forward).parameters)[:2] != ["kv_cache", "meta"]:
        raise TypeError(f"trace(model): expected a tokenspeed model (a torch.nn.Module whose forward takes "
                        f"kv_cache, meta), got {type(model).__name__}; ts.models.load(path) builds one")
    return Traced(trace_graph(model), getattr(model, "config", None))


@attrs.frozen(repr=False)
class Traced:
    """A traced model: ``forward(kv_cache, <metadata leaves>) -> logits of sampled rows``.
    Its repr is one line, as ``Lowered``'s: the module tree (hundreds of lines for the
    default model) is ``graph_module``'s, the IR ``as_text()``."""
    graph_module: fx.GraphModule
    config: object

    def __repr__(self) -> str:
        arch = getattr(self.config, "architecture", None) or type(self.config).__name__
        return f"Traced({arch}, {len(self.graph_module.graph.nodes)} nodes)"

    def as_text(self) -> str:
        return graph_text(self.graph_module.graph)

    def __str__(self) -> str:
        return self.as_text()

    def __call__(self, kv_cache: torch.Tensor, meta: ForwardMetadata) -> torch.Tensor:
        """Run the traced graph on the fields every descriptor has (no decoder view)."""
        names = input_names(self.graph_module)
        stage_checks.check_metadata(meta, names, "the traced model", "a DecodeMetadata or ExtendMetadata")
        return self.graph_module(kv_cache, **{n: getattr(meta, n) for n in names})

    def lower(self, mode: str = "decode", *, narrow: bool | None = None,
              decode_graph: bool | None = None, attention_breaks: bool | None = None) -> "Lowered":
        """``narrow`` (prefill; default True): derive the encoder/narrowing/decoder/finish stages.
        ``decode_graph`` (decode, verify; default True): keep attention inside the one
        captured segment. ``attention_breaks`` (prefill): run every attention eagerly
        between graphs, for a backend that cannot capture it; else each stage is one graph,
        attention included (default: so when narrowed; an unnarrowed program breaks at
        every attention). An option of another mode is refused, not ignored: a decode
        lowered with ``attention_breaks=True`` would still capture its attention."""
        stage_checks.check_lower_options(mode, narrow=narrow, decode_graph=decode_graph,
                                         attention_breaks=attention_breaks)
        narrow = narrow is not False
        program, history = run_pipeline(self.graph_module, self.config, mode, narrow=narrow,
                                         decode_graph=decode_graph is not False, attention_breaks=attention_breaks)
        return Lowered(mode, program, history, self.config, narrowed=mode == "prefill" and narrow)


@attrs.frozen
class Lowered:
    """One mode's program: segments (and, for a narrowed prefill, their stages) and the
    IR after every pass that made it."""
    mode: str
    program: Program = attrs.field(repr=False)
    history: tuple[HistoryEntry, ...] = attrs.field(repr=False)
    config: object = attrs.field(repr=False)
    narrowed: bool = False

    @property
    def segments(self) -> tuple[Segment, ...]:
        return self.program.segments

    @property
    def stages(self) -> dict[str, tuple[Segment, ...]]:
        """Prefill with narrowing: the segments of each stage, in order."""
        if not self.narrowed:
            return {}
        return {s: tuple(seg for seg in self.segments if seg.stage == s) for s in STAGES}

    def as_text(self) -> str:
        return f"# lowered {self.mode}\n" + self.program.as_text()

    def __str__(self) -> str:
        return self.as_text()

    def __call__(self, kv_cache: torch.Tensor, meta) -> torch.Tensor:
        """Run every segment eagerly, in order: the reference for any captured run."""
        produced, needed = {"kv_cache"}, []
        for seg in self.segments:
            needed += [name for name in seg.inputs if name not in produced and name not in needed]
            produced.update(seg.outputs)
        expected = stage_checks.METADATA_OF[self.mode]
        stage_checks.check_metadata(meta, needed, f"the lowered {self.mode} program", expected)
        return self.program(kv_cache, meta)

    def to_networkx(self) -> nx.DiGraph:
        """Segments as nodes; an edge carries the values one segment hands the next."""
        g = nx.DiGraph()
        producer = {}
        for seg in self.segments:
            g.add_node(seg.name, kind=seg.kind, stage=seg.stage)
            for value in seg.inputs:
                if value in producer:
                    edge = g.get_edge_data(producer[value], seg.name, {"values": []})
                    g.add_edge(producer[value], seg.name, values=edge["values"] + [value])
            producer.update({v: seg.name for v in seg.outputs})
        return g


@attrs.frozen
class Verification:
    """Speculative decoding's verify runner, to be compiled with prefill and decode: decode
    lowered in verify mode (``lowered``) and the most rows a request's window holds
    (``window``: its drafts and the token before them), which size its batches."""
    lowered: Lowered
    window: int = attrs.field(validator=attrs.validators.ge(1))


def compile(prefill: Lowered, decode: Lowered, config: CompileConfig = CompileConfig(), *,
            backend=None, workers: CompileWorkers | None = None,
            verify: "Verification | None" = None, companion_page_bytes: int = 0) -> "Compiled":
    """Bind a KV pool, build both runners and capture every graph, once (twice when the pool
    is sized by ``gpu_memory_utilization`` and the first pool bound is not the one the
    measurement after its captures chooses, see ``execution.kv_pool``).

    ``backend``: the backend tree (default: the leaf the model's caches need,
    ``backends.mla.backend_for``); lower decode with its ``graph_support().decode_graph``.
    ``workers``: kernel compile processes the caller started early (``ts.LLM`` starts them
    before tracing, so their imports overlap it).
    ``verify``: speculative decoding's third runner over the same pool (:class:`Verification`).
    ``companion_page_bytes``: a page of another pool to be bound with as many pages as this
    one, whose consumer keeps every page of a request (a draft model's): the budget pays for
    both, and pools are sized for whole contexts."""
    if not isinstance(config, CompileConfig):
        raise TypeError(f"compile(prefill, decode, config): config must be a ts.CompileConfig, got {config!r}")
    if config.device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"CompileConfig(device={str(config.device)!r}), but no CUDA GPU is available here")
    for name, lowered in (("prefill", prefill), ("decode", decode)):
        if not isinstance(lowered, Lowered) or lowered.mode != name:
            got = f"a {lowered.mode!r} program" if isinstance(lowered, Lowered) else type(lowered).__name__
            raise ValueError(f"compile(prefill, decode): the {name} argument is {got}; pass "
                             f"traced.lower({name!r})")
    stage_checks.check_one_model(prefill, decode, verify)
    backend = backend or backend_for(decode.config)
    stage_checks.check_prefill_attention(prefill, backend.graph_support())
    stage_checks.check_state_slots(decode, config)
    limits = config.resolve(decode.config)
    # the activations' dtype: a weight kept in GGUF blocks is uint8
    weights = next(p for p in decode.program.graph_module.parameters() if p.is_floating_point())
    geometry = kv_pool.geometry_for(decode.config, config.page_size, config.kv_dtype(weights.dtype), config.device)
    per_sequence = pages_per_sequence(decode.config.cache_groups, limits.max_model_len, config,
                                      whole_contexts=bool(companion_page_bytes))
    sizing = kv_pool.sized_by_bytes(config, geometry, per_sequence, companion_page_bytes=companion_page_bytes)
    pages = sizing.num_pages if sizing else kv_pool.first_pages(
        config.gpu_memory_utilization, geometry, max_num_seqs=config.max_num_seqs, pages_per_sequence=per_sequence,
        companion_page_bytes=companion_page_bytes)
    lowered = {"prefill": prefill, "decode": decode, **({"verify": verify.lowered} if verify else {})}
    binding = Binding(lowered=lowered, backend=backend, support=config.graph_support(backend.graph_support()),
                      config=config, limits=limits, geometry=geometry, pages_per_sequence=per_sequence,
                      verify_window=verify.window if verify else 1)
    if sizing is None:
        kv_pool.reset_peak(geometry.device)
    with workers or CompileWorkers(config.workers_for(binding.support)) as started:
        compiled = binding.bind(kv_pool.allocate(geometry, pages), started, sizing)
    if sizing is not None:
        return compiled
    start, probed = time.perf_counter(), compiled.startup
    sizing = kv_pool.sized_after_probe(config.gpu_memory_utilization, compiled.kv_cache, geometry,
                                       max_num_seqs=config.max_num_seqs, pages_per_sequence=per_sequence,
                                       companion_page_bytes=companion_page_bytes)
    if sizing.num_pages == pages:   # the first pool is the one the measurement chose
        return attrs.evolve(compiled, pool=sizing)
    del compiled       # the probe's pool and graphs go before the real pool is allocated
    _release_device_memory()
    compiled = binding.bind(kv_pool.allocate(geometry, sizing.num_pages), CompileWorkers(0), sizing)
    return attrs.evolve(   # the kernels were compiled for the probe's captures, once
        compiled, pool=attrs.evolve(compiled.pool, rebind_seconds=time.perf_counter() - start),
        startup=attrs.evolve(compiled.startup, kernel_variants_precompiled=probed.kernel_variants_precompiled,
                             precompile_seconds=probed.precompile_seconds))


def pages_per_sequence(groups, max_model_len: int, config: CompileConfig, whole_contexts: bool) -> int:
    """The pages one sequence at full length holds at once: every cache group's (a windowed
    group's only its window's and a chunk's); ``whole_contexts``: at least a whole context's,
    for a companion pool of as many pages that keeps every page (a draft model's)."""
    held = sum(most_pages_held(max_model_len, config.page_size, g.retention, config.max_num_batched_tokens)
               for g in groups)
    return max(held, most_pages_held(max_model_len, config.page_size)) if whole_contexts else held


@attrs.frozen
class Binding:
    """What binding a pool needs besides the pool: a rebind repeats it over another pool."""
    lowered: dict[str, Lowered] = attrs.field(repr=False)
    backend: object = attrs.field(repr=False)
    support: CudaGraphSupport
    config: CompileConfig
    limits: EngineLimits
    geometry: PoolGeometry
    pages_per_sequence: int          # the most one request at max_model_len holds at once
    verify_window: int = 1

    def check(self, pool: torch.Tensor) -> None:
        """Every node of the backend tree judges the pool before anything is built over it."""
        for node in walk(self.backend):
            node.check_pool(self.geometry, pool)

    def bind(self, pool: torch.Tensor, workers: CompileWorkers,
             sizing: kv_pool.PoolSizing | None) -> "Compiled":
        """Runners over ``pool``, every graph captured anew: nothing of an earlier binding
        (slots, captured addresses, republish latches) carries over."""
        self.check(pool)
        programs = {mode: lo.program for mode, lo in self.lowered.items()}
        prefill, decode, verify, startup = build_runners(
            programs, pool, self.backend, support=self.support, config=self.config, limits=self.limits,
            compile_workers=workers, verify_window=self.verify_window,
            num_groups=len(self.lowered["decode"].config.cache_groups))
        sizing = sizing or kv_pool.PoolSizing(pool.shape[2], self.geometry.page_bytes, self.pages_per_sequence,
                                              "the pool given")
        return Compiled(config=self.config, limits=self.limits, lowered=self.lowered, kv_cache=pool,
                        prefill=prefill, decode=decode, verify=verify, startup=startup, support=self.support,
                        pool=attrs.evolve(sizing, num_pages=pool.shape[2]), binding=self)


def _release_device_memory() -> None:
    """Collect dropped engines (their graphs form reference cycles) and return the caching
    allocator's free blocks, so what is measured next is what is held."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@attrs.define(eq=False)
class Compiled:
    """Both runners over one KV pool, graphs captured: ``prefill.run(chunks, sampling)`` and
    ``decode.run(rows, sampling)`` each run a batch (``sampling``: a ``RowSampling`` per
    sampled row) and return its sampled tokens.

    Not frozen: the runners it holds change with every batch they run (published slots,
    replayed graphs, the pool's pages), so a ``Compiled`` is a handle on live state,
    compared by identity, not a value; ``rebind`` gives another one over another pool."""
    config: CompileConfig
    limits: EngineLimits
    lowered: dict[str, Lowered] = attrs.field(repr=False)
    kv_cache: torch.Tensor = attrs.field(repr=False)
    prefill: PrefillRunner = attrs.field(repr=False)
    decode: DecodeRunner = attrs.field(repr=False)
    verify: DecodeRunner | None = attrs.field(repr=False)
    startup: StartupReport
    support: CudaGraphSupport
    pool: kv_pool.PoolSizing
    binding: Binding = attrs.field(repr=False)

    def rebind(self, pool: torch.Tensor) -> "Compiled":
        """This compilation over another KV pool: the same program, every graph captured
        anew, indistinguishable from a compile first bound to ``pool``. A pool whose
        geometry (anything but its page count) differs is refused before anything is built;
        this object is left as it was either way. Its requests' pages do not carry over."""
        return self.binding.bind(pool, CompileWorkers(0), None)

    @property
    def num_pages(self) -> int:
        return self.kv_cache.shape[2]

    def as_text(self) -> str:
        """What runs: each segment, whether it replays a graph, and over which ladder."""
        lines = [f"# compiled for {self.kv_cache.device}: {self.num_pages} KV pages of "
                 f"{self.config.page_size} tokens in {str(self.kv_cache.dtype).removeprefix('torch.')}, "
                 f"max_model_len={self.limits.max_model_len}",
                 self.pool.as_text(), self.startup.as_text()]
        replayed = {"prefill": {name for name, _ in self.prefill.graphs}}
        for mode, runner in (("decode", self.decode), ("verify", self.verify)):
            if mode in self.lowered:
                replayed[mode] = {s.name for s in self.lowered[mode].segments
                                  if s.kind == "graph" and runner.graphs}
        for mode, lowered in self.lowered.items():
            lines.append(f"\n## {mode}")
            for seg in lowered.segments:
                how = "graph" if seg.name in replayed[mode] else "eager"
                lines.append(f"  {seg.name:<28} {how:<5} ladder={seg.ladder}")
            lines += self._kernels_text(mode)
        return "\n".join(lines)

    def _kernels_text(self, mode: str) -> list[str]:
        """The kernels each captured decode (or verify) graph launches, by its rows, as the
        driver counts the graph's nodes; where they were not counted, why."""
        runner = {"decode": self.decode, "verify": self.verify}.get(mode)
        graphs = {} if runner is None else dict(sorted(runner.graphs.items()))
        if not graphs:
            return []
        uncounted = next((g.uncounted for g in graphs.values() if g.kernels is None), None)
        if uncounted is not None:
            return [f"  kernels a step: not counted ({uncounted})"]
        rows, first = next(iter(graphs.items()))
        layers = self.lowered[mode].config.num_layers
        by_rows = ", ".join(f"{n}: {g.kernels}" for n, g in graphs.items())
        return [f"  kernels a step, by rows: {by_rows} ({first.kernels / layers:.1f} a layer at {rows} rows over "
                f"{layers} layers, the embedding, head and draw included)"]

    def __str__(self) -> str:
        return self.as_text()

    def kernels_per_step(self, batch: int) -> int:
        """CUDA kernels one eager decode step of ``batch`` idle rows launches (its graph
        replays the same ones), counted with the profiler: CUDA only."""
        if self.kv_cache.device.type != "cuda":
            raise ValueError("kernels_per_step counts CUDA kernels: compile for a CUDA device")
        with torch.inference_mode():
            inputs = self.decode.idle_inputs(batch)     # published before: no copies counted
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                self.decode.step(*inputs)
                torch.cuda.synchronize()
        return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)

