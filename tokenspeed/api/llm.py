"""``ts.LLM``: load -> trace -> lower -> compile -> an engine; ``generate``, ``chat``, ``stream``.

Several threads may call one ``LLM``: their requests join the same running batch (each
caller steps the engine under one lock while its own requests are unfinished) and each
gets exactly its own outputs. Its ``client`` (``offline_client``) drives the engine
through the engine-client interface that the server's engine process drives too, and
answers each prompt as the server's API process does.
"""

from collections.abc import Callable, Iterator, Sequence

from tokenspeed import stages
from tokenspeed.backends.kernels.precompile import CompileWorkers
from tokenspeed.backends.mla import backend_for
from tokenspeed.backends.paged import PagedAttentionBackend
from tokenspeed.api import model_source
from tokenspeed.api.chat_messages import conversations, template_messages, template_variables
from tokenspeed.api.cpu_threads import size_torch_threads
from tokenspeed.api.llm_arguments import (checked_backend, checked_compile_options, checked_device, checked_dtype,
                                          checked_call_options, checked_flags, checked_quantization, checked_tokenizer,
                                          per_prompt)
from tokenspeed.api.model_source import tokenizer_path
from tokenspeed.api.offline_client import OfflineClient
from tokenspeed.api.progress import Progress
from tokenspeed.api.prompts import Prompt, chat_prompt, parse_prompts
from tokenspeed.execution import kv_pool
from tokenspeed.scheduling.block_allocator import BlockAllocator
from tokenspeed.execution.compile_config import CompileConfig
from tokenspeed.execution.startup import collector_paused
from tokenspeed.engine.draft_model import DraftModelDrafter
from tokenspeed.engine.core import Engine
from tokenspeed.engine.grammars import Grammars
from tokenspeed.execution.outputs import RequestOutput
from tokenspeed.scheduling.prompt_limits import check_request, fitted
from tokenspeed.scheduling.request import Request
from tokenspeed.execution.sampling_params import SamplingParams
from tokenspeed.scheduling.scheduler import Scheduler
from tokenspeed.engine.speculative import SpeculativeConfig
from tokenspeed.tokenizer import Tokenizer

from tokenspeed.api.hybrid_setup import checked_speculative, prepare_states, state_checkpoints

__all__ = ["LLM", "checked_device", "checked_dtype", "tokenizer_path"]


class LLM:
    def __init__(self, model=None, device="cpu", dtype=None, *, quantization: str | None = None,
                 tokenizer=None, revision: str | None = None,
                 enforce_eager: bool = False, overlap: bool = True,
                 enable_prefix_caching: bool = True, speculative: SpeculativeConfig | None = None,
                 backend=None, **compile_options):
        """``model``: a Hugging Face directory or model id (``owner/name``, through the
        Hugging Face cache; ``revision``: a branch, tag or commit of it), a GGUF file or a
        tokenspeed model (default: the embedded SmolLM2-135M-Instruct); on the CPU a GGUF file's
        block-format matrices (Q4_0 to Q8_0, Q4_K, Q5_K, Q6_K) stay in their blocks (float32 products by
        C kernels; ``model_source.kept_blocks``). ``dtype``: a torch dtype or its name (default:
        the checkpoint's). ``quantization="fp8"``: the linear layers' weights quantized to FP8
        at load, one scale per output channel (FP8 checkpoints load in FP8 without it);
        ``"int4"`` (the CPU): the layers to int4, a scale and zero per 32 inputs, the head to
        int8 per channel, run by torch's CPU kernels. ``tokenizer``: a path or a ``Tokenizer`` (default: the model
        path's). ``compile_options``: any :class:`CompileConfig` field (``page_size``,
        ``max_num_seqs``, ``max_model_len``, ``max_num_batched_tokens``, ``max_chunk_tokens``,
        ``num_kv_pages``, ``kv_cache_memory_bytes``, ``gpu_memory_utilization``,
        ``capture_sizes``, ``token_buckets``, ``view_width``, ``graphs``, ``seed``,
        ``compile_workers``, ``kv_cache_dtype``; another name is refused). ``kv_cache_dtype``:
        ``"auto"`` (the model's dtype) or ``"fp8_e4m3"``/``"fp8"``: the KV pool stores float8
        through the model's ``kv_scales``. ``enforce_eager``: no graphs, as
        ``graphs=False``.
        ``overlap``: prepare decode step n+1 while step n runs. ``enable_prefix_caching``:
        requests reuse the cached pages of prompts that start alike. ``speculative``: decode
        steps verify drafted tokens (``ts.SpeculativeConfig``; outputs are unchanged).
        Requests that give no ``SamplingParams`` take ``get_default_sampling_params()``."""
        if speculative is not None and not isinstance(speculative, SpeculativeConfig):
            raise TypeError(f"speculative must be a ts.SpeculativeConfig, got {speculative!r}")
        checked_flags(enforce_eager=enforce_eager, overlap=overlap, enable_prefix_caching=enable_prefix_caching)
        checked_tokenizer(tokenizer)
        checked_backend(backend)
        config = CompileConfig(device=checked_device(device),   # bad options refused before a model is found
                               **checked_compile_options(enforce_eager, compile_options))
        quantization = checked_quantization(quantization, config.device)
        model = model_source.model_path(model, revision)
        tokenizer = model_source.resolved(tokenizer)
        self._default_sampling = model_source.sampling_defaults_of(model)   # a bad file fails before loading
        size_torch_threads()
        # the workers start before the model (and so its leaf) is known: they compile the paged
        # leaf's variants, a superset of what a latent-attention model captures
        wanted = config.graph_support((backend or PagedAttentionBackend()).graph_support())
        with collector_paused(), CompileWorkers(config.workers_for(wanted)) as workers:  # imports overlap loading
            reader = model_source.gguf_reader(model)  # model and tokenizer read one parse of the file
            self.model = model_source.as_model(model, checked_dtype(dtype), config.device, reader,
                                               quantization)
            self.tokenizer = model_source.tokenizer_of(tokenizer, model, reader)
            backend = backend or backend_for(self.model.config)
            checked_speculative(self.model.config, speculative)
            checkpoints = state_checkpoints(self.model.config, config.max_num_seqs, enable_prefix_caching)
            prepare_states(self.model, config.max_num_seqs, checkpoints, config.gpu_memory_utilization)
            self.traced = stages.trace(self.model)
            draft = None
            if speculative is not None and speculative.method == "draft":
                draft = self._draft_model(speculative, config, device, dtype, enforce_eager, compile_options)
            self.compiled = self._compile(config, backend, workers, speculative, draft)
        drafter = speculative if draft is None else self._drafter(draft, speculative.num_tokens)
        self.engine = self._engine(config, overlap, enable_prefix_caching, speculative, drafter, checkpoints)
        self.client = OfflineClient(self.engine, self.tokenizer)

    @property
    def config(self):
        return self.model.config

    def _compile(self, config: CompileConfig, backend, workers: CompileWorkers,
                 speculative: SpeculativeConfig | None, draft: "LLM | None") -> stages.Compiled:
        """Every mode lowered for what ``backend`` can capture, compiled over one pool; with a
        draft model, the pool leaves room for the draft's pool of as many pages."""
        support = backend.graph_support()
        verify = stages.Verification(self.traced.lower("verify", decode_graph=support.decode_graph),
                                     speculative.window) if speculative else None
        return stages.compile(self.traced.lower("prefill", attention_breaks=not support.prefill_attention),
                              self.traced.lower("decode", decode_graph=support.decode_graph), config,
                              backend=backend, workers=workers, verify=verify,
                              companion_page_bytes=draft.compiled.binding.geometry.page_bytes if draft else 0)

    def _engine(self, config: CompileConfig, overlap: bool, enable_prefix_caching: bool,
                speculative: SpeculativeConfig | None, drafter, checkpoints) -> Engine:
        """The engine over the compiled runners, its scheduler sized by ``config`` and the pool
        (and a recurrent model's ``checkpoints``); grammars compile against the tokenizer's
        vocabulary (llguidance's view of it is built at the first constrained request)."""
        scheduler = Scheduler(BlockAllocator(self.compiled.num_pages), page_size=config.page_size,
                              max_num_seqs=config.max_num_seqs,
                              max_num_batched_tokens=config.max_num_batched_tokens,
                              prefix_caching=enable_prefix_caching,
                              retentions=tuple(g.retention for g in self.model.config.cache_groups),
                              max_chunk_tokens=config.chunk_tokens(),
                              recurrent=self.config.hybrid is not None, checkpoints=checkpoints)
        grammars = Grammars(self.tokenizer, self.model.config.vocab_size) if self.tokenizer is not None else None
        return Engine(scheduler, prefill=self.compiled.prefill, decode=self.compiled.decode,
                      model_config=self.model.config, max_model_len=self.compiled.limits.max_model_len,
                      overlap=overlap, seed=config.seed, verify=self.compiled.verify,
                      drafter=drafter, verify_cost=speculative.verify_cost if speculative else 1.0,
                      grammars=grammars, states=self.model.model.state_pools if checkpoints else None)

    def _draft_model(self, speculative: SpeculativeConfig, config: CompileConfig, device, dtype,
                     enforce_eager: bool, compile_options: dict) -> "LLM":
        """The draft model, compiled like this one over a stand-in pool of 2 pages (rebound by
        ``_drafter`` to as many pages as ours, which the budget pays for together); refused
        unless it has this model's vocabulary and context."""
        draft = LLM(speculative.draft_model, device, dtype, enforce_eager=enforce_eager, overlap=False,
                    enable_prefix_caching=False, **{**compile_options, "num_kv_pages": 2})
        if draft.config.hybrid is not None:
            raise ValueError(f"the draft model ({draft.config.architecture}) has recurrent layers, whose state "
                             f"is not rolled back past rejected drafts: a draft model attends over its cache alone")
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
                 *, use_tqdm: bool | Callable = True, **vllm_options) -> list[RequestOutput]:
        """Complete every prompt (text, token ids or prompt dicts; see ``prompts``).
        ``use_tqdm``: show a progress bar, or (as vLLM's) a callable that makes it, such as
        ``functools.partial(tqdm, leave=False)``. ``vllm_options``: vLLM's ``lora_request``,
        ``priority``, ... at the values that change nothing here (``VLLM_CALL_ARGUMENTS``)."""
        checked_call_options(vllm_options, "generate()")
        return self._generate(parse_prompts(prompts, self.tokenizer), sampling_params, use_tqdm)

    def _generate(self, parsed: list[Prompt], sampling_params, use_tqdm: bool | Callable) -> list[RequestOutput]:
        params = self._defaults_for(parsed) if sampling_params is None else \
            per_prompt(sampling_params, len(parsed))
        for i, (prompt, p) in enumerate(zip(parsed, params)):
            self.check(i, prompt, p)
        keys = self.client.add(parsed, params, streamed=False)   # answered whole: text decoded at the end
        groups = [self.client.requests(key) for key in keys]
        try:
            with Progress(groups, use_tqdm) as progress:
                self.client.serve([r for g in groups for r in g], progress.update)
        except BaseException:
            self.client.drop(keys)   # an interrupt: nothing of this call runs on
            raise
        self.client.raise_failure(keys)
        return [self.client.answer(prompt, key) for prompt, key in zip(parsed, keys)]

    def chat(self, messages, sampling_params=None, *, add_generation_prompt: bool = True,
             use_tqdm: bool | Callable = True, tools: list[dict] | None = None,
             chat_template_kwargs: dict | None = None, chat_template: str | None = None,
             continue_final_message: bool = False, **vllm_options) -> list[RequestOutput]:
        """Complete conversations (a list of ``{"role", "content"}`` messages, or a list of
        such lists; see ``chat_messages``) through the model's chat template (or
        ``chat_template``, a Jinja template's text), which also sees ``tools`` and
        ``chat_template_kwargs`` (``{"enable_thinking": False}``), as vLLM's ``LLM.chat``
        passes them. ``continue_final_message`` (with ``add_generation_prompt=False``): the
        model goes on writing the last message (an assistant's reply begun for it).
        ``vllm_options``: as ``generate``'s (``chat_template_content_format`` "auto" or
        "string" too: the template sees each content as one string)."""
        checked_call_options(vllm_options, "chat()")
        variables = template_variables(tools, chat_template_kwargs)
        prompts = [chat_prompt(self._require_tokenizer(), c, add_generation_prompt, chat_template=chat_template,
                               continue_final_message=continue_final_message, **variables)
                   for c in conversations(messages)]
        return self._generate(prompts, sampling_params, use_tqdm)

    def chat_prompt(self, messages, add_generation_prompt: bool = True) -> Prompt:
        """One conversation as a prompt, through the model's chat template."""
        return chat_prompt(self._require_tokenizer(), template_messages(messages), add_generation_prompt)

    def stream(self, prompt, sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """The text of one prompt's completion, piece by piece as it is generated (a bad
        prompt or params are refused here, at the call, not at the first piece)."""
        parsed = parse_prompts(prompt, self.tokenizer)
        if len(parsed) != 1:
            raise ValueError(f"stream takes one prompt (a string, token ids or a prompt dict), got "
                             f"a list of {len(parsed)}: use generate for several")
        [params] = self._defaults_for(parsed) if sampling_params is None else per_prompt(sampling_params, 1)
        if params.n != 1:
            raise ValueError(f"stream takes one completion: n={params.n}")
        self._require_tokenizer()
        self.check(0, parsed[0], params)
        return self._pieces(parsed[0], params)

    def _pieces(self, parsed: Prompt, params: SamplingParams) -> Iterator[str]:
        [key] = self.client.add([parsed], [params])
        [request], [text] = self.client.requests(key), self.client.output(key).completions
        try:
            while not request.finished:
                self.client.serve([request], lambda finished: None, steps=1)
                if piece := text.take_unread():   # a step whose token adds no text yet yields nothing
                    yield piece
            if last := text.take_unread():   # what arrived while another caller's steps finished it
                yield last
            self.client.raise_failure([key])
        finally:
            self.client.drop([key])   # a consumer that stopped early

    def _defaults_for(self, prompts: list[Prompt]) -> list[SamplingParams]:
        """The defaults, for a call that gave none: their ``max_tokens`` (the model's
        ``max_new_tokens`` or ``SamplingParams``' 16) cut to the room the context leaves each
        prompt (``prompt_limits.fitted``), not refused: the caller never asked for it."""
        defaults = self.get_default_sampling_params()
        return [fitted(self.engine.limits, len(p.token_ids), defaults) for p in prompts]

    def get_default_sampling_params(self) -> SamplingParams:
        """What a request samples with when it gives no ``SamplingParams`` (vLLM's name):
        the model's generation_config.json settings, else ``SamplingParams()``'s."""
        return SamplingParams(**self._default_sampling)

    @property
    def sampling_defaults(self) -> dict:
        """The sampling fields the model's generation_config.json sets (as vLLM's
        ``get_diff_sampling_param``), what ``get_default_sampling_params`` builds on."""
        return dict(self._default_sampling)

    def get_tokenizer(self) -> Tokenizer:
        """The engine's tokenizer (vLLM's name); an engine without one says so."""
        return self._require_tokenizer()

    def check(self, index: int, prompt: Prompt, params: SamplingParams) -> None:
        """Refuse, naming prompt ``index`` (or the field), what this engine cannot serve: a
        grammar that does not compile too, before anything is queued."""
        check_request(self.engine.limits, index, prompt.token_ids, params,
                      has_tokenizer=self.tokenizer is not None)
        if params.structured_outputs is not None:
            self.engine.grammars.check(params.structured_outputs)

    def add(self, prompts: list[Prompt], params: list[SamplingParams]) -> list[list[Request]]:
        """Queue checked prompts; each becomes its ``n`` requests. All or none: a prompt
        refused takes those queued before it out again."""
        return [self.client.requests(key) for key in self.client.add(prompts, params)]

    def step(self) -> None:
        """One engine step for everyone's requests, and their text. A step that fails
        aborts every request then in the engine, and raises."""
        self.client.step()

    def abort(self, requests: list[Request]) -> None:
        """Finish the unfinished ``requests`` now, returning their pages."""
        self.client.abort(requests)

    def release(self, requests: list[Request]) -> None:
        """Forget the answers of the prompts of finished ``requests``."""
        self.client.release(requests)

    def _require_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise ValueError("this engine has no tokenizer: load a model whose files hold a tokenizer.json, "
                             "or pass tokenizer=")
        return self.tokenizer
