"""``ts.LLM``: load -> trace -> lower -> compile -> an engine; ``generate``, ``chat``, ``stream``.

Several threads may call one ``LLM``: their requests join the same running batch (each
caller steps the engine under one lock while its own requests are unfinished) and each
gets exactly its own outputs. The server's engine loop drives the same engine through the
same methods (``check``, ``add``, ``step``, ``abort``, ``text_of``, ``release``).
"""

import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from tqdm import tqdm

from tokenspeed import stages
from tokenspeed.backends.kernels.precompile import CompileWorkers
from tokenspeed.backends.paged import PagedAttentionBackend
from tokenspeed.entrypoints.prompts import Prompt, chat_prompt, check_request, parse_prompts
from tokenspeed.entrypoints.text_stream import TextStream
from tokenspeed.models.gguf import PlainGGUFReader, default_model_path, is_gguf
from tokenspeed.models.loader import load
from tokenspeed.runtime import kv_pool
from tokenspeed.runtime.block_allocator import BlockAllocator
from tokenspeed.runtime.compile_config import CompileConfig
from tokenspeed.runtime.draft_model import DraftModelDrafter
from tokenspeed.runtime.engine import Engine
from tokenspeed.runtime.outputs import RequestMetrics, RequestOutput
from tokenspeed.runtime.request import Request
from tokenspeed.runtime.sampling_params import SamplingParams
from tokenspeed.runtime.scheduler import Scheduler
from tokenspeed.runtime.speculative import SpeculativeConfig
from tokenspeed.tokenizer import Tokenizer, load_tokenizer

DTYPES = {"float32": torch.float32, "float": torch.float32, "float16": torch.float16,
          "half": torch.float16, "bfloat16": torch.bfloat16, "auto": None}


class LLM:
    def __init__(self, model=None, device="cpu", dtype=None, *, tokenizer=None,
                 enforce_eager: bool = False, overlap: bool = True,
                 enable_prefix_caching: bool = True, speculative: SpeculativeConfig | None = None,
                 backend=None, **compile_options):
        """``model``: a Hugging Face directory, a GGUF file or a tokenspeed model (default:
        the embedded SmolLM2-135M-Instruct). ``dtype``: a torch dtype or its name (default:
        the checkpoint's). ``tokenizer``: a path or a ``Tokenizer`` (default: the model
        path's). ``compile_options``: any :class:`CompileConfig` field (``page_size``,
        ``max_num_seqs``, ``max_model_len``, ``max_num_batched_tokens``, ``max_chunk_tokens``,
        ``num_kv_pages``, ``kv_cache_memory_bytes``, ``gpu_memory_utilization``,
        ``capture_sizes``, ``token_buckets``, ``view_width``, ``graphs``, ``seed``,
        ``compile_workers``). ``enforce_eager``: no graphs, as ``graphs=False``.
        ``overlap``: prepare decode step n+1 while step n runs. ``enable_prefix_caching``:
        requests reuse the cached pages of prompts that start alike. ``speculative``: decode
        steps verify drafted tokens (``ts.SpeculativeConfig``; outputs are unchanged)."""
        if speculative is not None and not isinstance(speculative, SpeculativeConfig):
            raise TypeError(f"speculative must be a ts.SpeculativeConfig, got {speculative!r}")
        model = default_model_path() if model is None else model
        config = CompileConfig(device=checked_device(device),
                               **_graphs_option(enforce_eager, compile_options))
        backend = backend or PagedAttentionBackend()
        wanted = config.graph_support(backend.graph_support())
        with CompileWorkers(config.workers_for(wanted)) as workers:  # imports overlap loading
            reader = _gguf_reader(model)  # model and tokenizer read one parse of the file
            self.model = _as_model(model, checked_dtype(dtype), config.device, reader)
            self.tokenizer = _tokenizer(tokenizer, model, reader)
            self.traced = stages.trace(self.model)
            draft = None
            if speculative is not None and speculative.method == "draft":
                draft = self._draft_model(speculative, config, device, dtype, enforce_eager, compile_options)
            support = backend.graph_support()
            verify = self.traced.lower("verify", decode_graph=support.decode_graph) if speculative else None
            prefill = self.traced.lower("prefill", attention_breaks=not support.prefill_attention)
            self.compiled = stages.compile(prefill, self.traced.lower("decode", decode_graph=support.decode_graph),
                                           config, backend, workers, verify,
                                           speculative.window if speculative else 1,
                                           draft.compiled.binding.geometry.page_bytes if draft else 0)
        drafter = speculative if draft is None else self._drafter(draft, speculative.num_tokens)
        scheduler = Scheduler(BlockAllocator(self.compiled.num_pages), config.page_size,
                              config.max_num_seqs, config.max_num_batched_tokens,
                              enable_prefix_caching,
                              retentions=tuple(g.retention for g in self.model.config.cache_groups),
                              max_chunk_tokens=config.chunk_tokens())
        self.engine = Engine(scheduler, self.compiled.prefill, self.compiled.decode,
                             self.model.config, self.compiled.limits.max_model_len, overlap,
                             config.seed, self.compiled.verify, drafter,
                             verify_cost=speculative.verify_cost if speculative else 1.0)
        self._lock = threading.Lock()
        self._streams: dict[Request, TextStream] = {}
        self._failures, self._failure = 0, None   # failed steps so far, and the last error

    @property
    def config(self):
        return self.model.config

    def _draft_model(self, speculative: SpeculativeConfig, config: CompileConfig, device, dtype,
                     enforce_eager: bool, compile_options: dict) -> "LLM":
        """The draft model, compiled like this one over a stand-in pool of 2 pages (rebound by
        ``_drafter`` to as many pages as ours, which the budget pays for together); refused
        unless it has this model's vocabulary and context."""
        draft = LLM(speculative.draft_model, device, dtype, enforce_eager=enforce_eager, overlap=False,
                    enable_prefix_caching=False, **{**compile_options, "num_kv_pages": 2})
        if len(draft.config.cache_groups) > 1:
            raise ValueError("the draft model mixes sliding-window and full-attention layers (several cache "
                             "groups): a draft model keeps one page list per request")
        if draft.config.vocab_size != self.config.vocab_size:
            raise ValueError(f"the draft model's vocabulary has {draft.config.vocab_size} tokens, the "
                             f"target's {self.config.vocab_size}: drafts must be the target's tokens")
        ours, theirs = config.resolve(self.config).max_model_len, draft.compiled.limits.max_model_len
        if theirs < ours:
            raise ValueError(f"the draft model's context ({theirs} tokens) is shorter than the "
                             f"target's ({ours}): drafts past it could not be proposed")
        return draft

    def _drafter(self, draft: "LLM", num_tokens: int) -> DraftModelDrafter:
        """The draft model's runners over a pool of as many pages as ours: its drafter keeps
        every page of a request, and our pool was sized for whole contexts to match."""
        pool = kv_pool.allocate(draft.compiled.binding.geometry, self.compiled.num_pages)
        compiled = draft.compiled.rebind(pool)
        return DraftModelDrafter(compiled.prefill, compiled.decode, compiled.num_pages,
                                 compiled.config.page_size, num_tokens)

    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 *, use_tqdm: bool = True) -> list[RequestOutput]:
        """Complete every prompt (text, token ids or prompt dicts; see ``prompts``)."""
        return self._generate(parse_prompts(prompts, self.tokenizer), sampling_params, use_tqdm)

    def _generate(self, parsed: list[Prompt], sampling_params, use_tqdm: bool) -> list[RequestOutput]:
        params = _per_prompt(sampling_params, len(parsed))
        for i, (prompt, p) in enumerate(zip(parsed, params)):
            self.check(i, prompt, p)
        groups = self.add(parsed, params)
        requests = [r for g in groups for r in g]
        try:
            with _Progress(groups, use_tqdm) as progress:
                self._serve(requests, progress.update)
        except BaseException:
            self.abort(requests)   # an interrupt: nothing of this call runs on
            self.release(requests)
            raise
        return [self._output(prompt, group) for prompt, group in zip(parsed, groups)]

    def chat(self, messages, sampling_params=None, *, add_generation_prompt: bool = True,
             use_tqdm: bool = True) -> list[RequestOutput]:
        """Complete conversations (a list of ``{"role", "content"}`` messages, or a list of
        such lists) through the model's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.chat_prompt(c, add_generation_prompt) for c in conversations]
        return self._generate(prompts, sampling_params, use_tqdm)

    def chat_prompt(self, messages, add_generation_prompt: bool = True) -> Prompt:
        """One conversation as a prompt, through the model's chat template."""
        return chat_prompt(self._require_tokenizer(), messages, add_generation_prompt)

    def stream(self, prompt, sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """The text of one prompt's completion, piece by piece as it is generated."""
        [parsed] = parse_prompts(prompt, self.tokenizer)
        params = sampling_params or SamplingParams()
        if params.n != 1:
            raise ValueError(f"stream takes one completion: n={params.n}")
        self._require_tokenizer()
        self.check(0, parsed, params)
        [[request]] = self.add([parsed], [params])
        try:
            while not request.finished:
                self._serve([request], lambda finished: None, steps=1)
                yield self.text_of(request).take_unread()
        finally:
            self.abort([request])   # a consumer that stopped early
            self.release([request])

    def check(self, index: int, prompt: Prompt, params: SamplingParams) -> None:
        """Refuse, naming prompt ``index``, what this engine cannot serve."""
        check_request(self.engine.limits, self.tokenizer is not None, index, prompt, params)

    def add(self, prompts: list[Prompt], params: list[SamplingParams]) -> list[list[Request]]:
        """Queue checked prompts; each becomes its ``n`` requests (and their text streams)."""
        with self._lock:
            groups = [self.engine.add(p.token_ids, sp) for p, sp in zip(prompts, params)]
            if self.tokenizer is not None:
                self._streams.update({r: TextStream(self.tokenizer, r.params) for g in groups for r in g})
            return groups

    def _serve(self, requests: list[Request], on_finish, steps: int | None = None) -> None:
        """Step the engine until ``requests`` finish (or ``steps`` steps ran); every step
        advances every caller's requests and their text, so a request may finish in a
        step another caller ran: each is reported to ``on_finish`` once, whoever stepped."""
        unreported, done, failures, scanned = list(requests), 0, self._failures, None
        while True:
            if self.engine.num_finished != scanned:   # a scan of thousands of requests is
                scanned = self.engine.num_finished     # host time of every step: only on news
                for request in [r for r in unreported if r.finished]:
                    on_finish(request)
                unreported = [r for r in unreported if not r.finished]
            if not unreported or (steps is not None and done >= steps):
                return
            with self._lock:
                if self._failures != failures and any(r.finish_reason == "abort" for r in unreported):
                    raise RuntimeError("the engine failed in a step another caller ran; "
                                       "its requests were aborted") from self._failure
                if self.engine.num_finished == scanned:   # else some may be done: rescan first
                    self._step()
                    done += 1

    def step(self) -> None:
        """One engine step for everyone's requests, and their text. A step that fails
        aborts every request then in the engine, and raises."""
        with self._lock:
            self._step()

    def _step(self) -> None:
        with torch.inference_mode():
            try:
                self.engine.step()
            except BaseException as exc:
                self._failures, self._failure = self._failures + 1, exc
                self.engine.abort_all()
                raise
            self._update_text()

    def abort(self, requests: list[Request]) -> None:
        """Finish the unfinished ``requests`` now, returning their pages."""
        with self._lock:
            for request in requests:
                self.engine.finish(request, "abort")

    def text_of(self, request: Request) -> TextStream | None:
        return self._streams.get(request)

    def release(self, requests: list[Request]) -> list[TextStream | None]:
        """Forget the text streams of finished ``requests``; returns them."""
        with self._lock:
            return [self._streams.pop(r, None) for r in requests]

    def _update_text(self) -> None:
        """Read new tokens into every open stream; a stop string finishes its request."""
        for request, stream in self._streams.items():
            if stream.seen < len(request.output) or (request.finished and not stream.closed):
                stream.update(request.output, request.finished)
                if stream.stop_string is not None and request.stop_reason != stream.stop_string and \
                        (request.finish_reason != "stop" or stream.kept_tokens < len(request.output)):
                    self._stopped_by_text(request, stream.stop_string)   # it came first

    def _stopped_by_text(self, request: Request, stop_string: str) -> None:
        """A stop string ends the request, also one that its length limit ended in the
        same token: the reason is the stop string."""
        if request.finished:
            request.finish_reason, request.stop_reason = "stop", stop_string
        else:
            self.engine.finish(request, "stop", stop_string)

    def _output(self, prompt: Prompt, group: list[Request]) -> RequestOutput:
        streams = self.release(group)
        completions = tuple(r.completion() if s is None else r.completion(s.text, s.kept_tokens)
                            for r, s in zip(group, streams))
        first = [r.first_token_time for r in group if r.first_token_time is not None]
        windows = sum(r.num_verify_steps for r in group)
        metrics = RequestMetrics(group[0].arrival_time, min(first, default=None),
                                 max(r.finish_time for r in group), len(prompt.token_ids),
                                 sum(len(c.token_ids) for c in completions),
                                 group[0].num_cached_prompt_tokens,
                                 sum(r.num_verified_tokens for r in group) / windows if windows else None)
        return RequestOutput(group[0].id, prompt.token_ids, completions, metrics, prompt.text)

    def _require_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise ValueError("this engine has no tokenizer: load the model from a path, or "
                             "pass tokenizer=")
        return self.tokenizer


class _Progress:
    """A bar over a ``generate`` call's prompts, with input and output tokens per second."""

    def __init__(self, groups: list[list[Request]], enabled: bool):
        self.left = {id(r): g for g in groups for r in g}
        self.bar = tqdm(total=len(groups), desc="generating", unit="prompt", disable=not enabled,
                        dynamic_ncols=True)
        self.start, self.prompt_tokens, self.output_tokens = time.perf_counter(), 0, 0

    def update(self, request: Request) -> None:
        group = self.left.pop(id(request))
        if all(r.finished for r in group) and not any(id(r) in self.left for r in group):
            self.prompt_tokens += len(group[0].prompt)
            self.output_tokens += sum(len(r.output) for r in group)
            elapsed = max(time.perf_counter() - self.start, 1e-9)
            self.bar.set_postfix_str(f"input {self.prompt_tokens / elapsed:.0f} tok/s, "
                                     f"output {self.output_tokens / elapsed:.0f} tok/s")
            self.bar.update(1)

    def __enter__(self) -> "_Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.bar.close()


def checked_device(device) -> torch.device:
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device={device!r} is not a device (cpu, cuda, cuda:N)") from exc
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={str(device)!r}, but no CUDA GPU is available here: use device='cpu'")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device={str(device)!r}: tokenspeed runs on cpu or cuda")
    return device


def checked_dtype(dtype) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str) and dtype.removeprefix("torch.") in DTYPES:
        return DTYPES[dtype.removeprefix("torch.")]
    raise ValueError(f"dtype={dtype!r}: expected one of {', '.join(DTYPES)} or a torch dtype")


def _graphs_option(enforce_eager: bool, options: dict) -> dict:
    if not enforce_eager:
        return options
    if options.get("graphs"):
        raise ValueError("enforce_eager=True and graphs=True contradict each other")
    return {**options, "graphs": False}


def _gguf_reader(model):
    return PlainGGUFReader(model) if isinstance(model, (str, Path)) and is_gguf(model) and \
        Path(model).is_file() else None


def _as_model(model, dtype, device, reader=None):
    if isinstance(model, (str, Path)):
        return load(model, dtype=dtype, device=device, gguf_reader=reader)
    if not hasattr(model, "config"):
        raise TypeError(f"expected a checkpoint path or a tokenspeed model, got {type(model).__name__}")
    return model.to(device=device, dtype=dtype).eval() if dtype else model.to(device).eval()


def _tokenizer(tokenizer, model, reader=None) -> Tokenizer | None:
    """The tokenizer asked for, else the model path's if it brings one (a directory of
    weights alone serves token-id prompts only)."""
    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    if tokenizer is not None:
        return load_tokenizer(tokenizer)
    path = tokenizer_path(model) if isinstance(model, (str, Path)) else None
    return None if path is None else load_tokenizer(path, reader)


def tokenizer_path(model: str | Path) -> str | None:
    """The model path, if it brings a tokenizer (a directory of weights alone does not)."""
    path = Path(model)
    return None if path.is_dir() and not (path / "tokenizer.json").is_file() else str(model)


def _per_prompt(params, n: int) -> list[SamplingParams]:
    if params is None or isinstance(params, SamplingParams):
        return [params or SamplingParams()] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"{len(params)} sampling params for {n} prompts")
    bad = next((p for p in params if not isinstance(p, SamplingParams)), None)
    if bad is not None:
        raise TypeError(f"sampling_params must be SamplingParams, got {type(bad).__name__}")
    return params
