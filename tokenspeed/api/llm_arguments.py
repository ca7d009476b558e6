"""What ``ts.LLM``'s arguments may be, checked before anything loads: its device, dtype,
compile options (``CompileConfig``'s fields) and per-prompt sampling params. A bad one is
refused naming the argument and what is accepted, not deep inside a constructor."""

from pathlib import Path

import attrs
import torch

from tokenspeed.backends.paged import PagedAttentionBackend
from tokenspeed.errors import did_you_mean
from tokenspeed.execution.compile_config import CompileConfig, as_device
from tokenspeed.execution.sampling_params import SamplingParams
from tokenspeed.tokenizer import Tokenizer

LLM_OPTIONS = ("model", "device", "dtype", "quantization", "tokenizer", "revision", "enforce_eager",
               "overlap", "enable_prefix_caching", "speculative", "backend")
QUANTIZATIONS = ("fp8", "int4")

# vLLM's arguments tokenspeed has no use for: the values that change nothing here (so a
# ported script that spells them out runs), and why another is refused
VLLM_ENGINE_ARGUMENTS = {
    "tensor_parallel_size": ((1,), "a model runs on one device here"),
    "pipeline_parallel_size": ((1,), "a model runs on one device here"),
    "data_parallel_size": ((1,), "a model runs on one device here"),
    "trust_remote_code": ((True, False), "the models run tokenspeed's own code, never a checkpoint's"),
    "enable_chunked_prefill": ((True, None), "prefill is always chunked (max_chunk_tokens)"),
    "tokenizer_mode": (("auto",), "the tokenizer is the model's tokenizer.json"),
    "skip_tokenizer_init": ((False,), "pass tokenizer= to choose one"),
    "enable_lora": ((False,), "no LoRA adapters"),
    "block_size": ((None,), "its name here is page_size"),
}
VLLM_CALL_ARGUMENTS = {
    "lora_request": ((None,), "no LoRA adapters"),
    "priority": ((None,), "requests are scheduled first come, first served"),
    "tokenization_kwargs": ((None,), "prompts are encoded as the tokenizer's defaults say"),
    "mm_processor_kwargs": ((None,), "the models served here read text alone"),
    "chat_template_content_format": (("auto", "string"), "the template sees each message's content as one "
                                                          "string, text parts joined"),
}

DTYPES = {"float32": torch.float32, "float": torch.float32, "float16": torch.float16,
          "half": torch.float16, "bfloat16": torch.bfloat16, "auto": None}


def checked_flags(**flags) -> None:
    """On/off arguments are booleans: a string such as ``"no"`` would read as on."""
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name}={value!r}: must be True or False")


def checked_tokenizer(tokenizer) -> None:
    if tokenizer is not None and not isinstance(tokenizer, (str, Path, Tokenizer)):
        raise TypeError(f"tokenizer={tokenizer!r}: must be a path, a Hugging Face model id or a "
                        f"tokenspeed Tokenizer (None: the model's own)")


def checked_backend(backend) -> None:
    if backend is not None and not isinstance(backend, PagedAttentionBackend):
        raise TypeError(f"backend={backend!r}: must be an attention backend object (a "
                        f"PagedAttentionBackend; None: the model's own)")


def checked_device(device) -> torch.device:
    device = as_device(device)
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


def checked_quantization(quantization, device: torch.device) -> str | None:
    if quantization == "int4" and device.type != "cpu":
        raise ValueError(f"quantization='int4' runs on the CPU (torch's int4 CPU kernel), not on "
                         f"{device}; on a GPU use 'fp8' or a GGUF file's blocks")
    if quantization is None or quantization in QUANTIZATIONS:
        return quantization
    raise ValueError(f"quantization={quantization!r}: expected one of {', '.join(QUANTIZATIONS)}, or None for "
                     f"the weights as stored (on the command line: leave the flag out; FP8 checkpoints load "
                     f"in FP8 without it)")


def without_vllm_arguments(options: dict, known: dict, where: str) -> dict:
    """``options`` less the vLLM arguments of ``known`` given a value that changes nothing
    here; another value of one is refused naming it and why."""
    for name, value in options.items():
        accepted, why = known.get(name, ((), ""))
        if name in known and not any(value is a or (type(value) is type(a) and value == a) for a in accepted):
            shown = " or ".join(map(repr, accepted))
            raise ValueError(f"{where} {name}={value!r}: vLLM's {name} is not supported here ({why}); only "
                             f"{shown} is accepted")
    return {name: value for name, value in options.items() if name not in known}


def checked_call_options(options: dict, where: str) -> None:
    """``generate``'s and ``chat``'s further keywords: vLLM's at a value that changes
    nothing; any other name is a ``TypeError`` naming it, not Python's bare one."""
    unknown = without_vllm_arguments(options, VLLM_CALL_ARGUMENTS, where)
    if unknown:
        name = next(iter(unknown))
        hint = did_you_mean(name, ("use_tqdm", *VLLM_CALL_ARGUMENTS))
        raise TypeError(f"{where} got an unknown argument {name!r}{hint}")


def checked_compile_options(enforce_eager: bool, options: dict) -> dict:
    """``CompileConfig`` keyword arguments: ``options`` once every name is known, with
    ``enforce_eager`` as ``graphs=False``."""
    fields = tuple(attrs.fields_dict(CompileConfig))
    options = without_vllm_arguments(options, VLLM_ENGINE_ARGUMENTS, "LLM()")
    unknown = [name for name in options if name not in fields]
    if unknown:
        raise TypeError(f"LLM() got an unknown argument {unknown[0]!r}{_close_to(unknown[0], fields)}; "
                        f"it takes {', '.join(LLM_OPTIONS)}, and CompileConfig's "
                        f"{', '.join(f for f in fields if f != 'device')}")
    return _graphs_option(enforce_eager, options)


def _close_to(name: str, fields: tuple[str, ...]) -> str:
    return did_you_mean(name, LLM_OPTIONS + fields)


def _graphs_option(enforce_eager: bool, options: dict) -> dict:
    if not enforce_eager:
        return options
    if options.get("graphs"):
        raise ValueError("enforce_eager=True and graphs=True contradict each other")
    return {**options, "graphs": False}


def per_prompt(params, n: int) -> list[SamplingParams]:
    """One ``SamplingParams`` per prompt: ``params`` for all, or one each."""
    if isinstance(params, SamplingParams):
        return [params] * n
    if isinstance(params, (str, bytes, dict)) or not hasattr(params, "__iter__"):
        raise TypeError(f"sampling_params must be a SamplingParams or a list of them, got "
                        f"{type(params).__name__}")
    params = list(params)
    if len(params) != n:
        raise ValueError(f"{len(params)} sampling params for {n} prompts")
    bad = next((p for p in params if not isinstance(p, SamplingParams)), None)
    if bad is not None:
        raise TypeError(f"sampling_params must be SamplingParams, got {type(bad).__name__}")
    return params
