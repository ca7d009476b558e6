"""What ``ts.LLM`` reads from its ``model`` argument: the model, its tokenizer and its
sampling defaults (a path's), each read once."""

import logging
from pathlib import Path

import torch

from tokenspeed.backends.kernels import cpu_blocks
from tokenspeed.models.generation_config import FILE_NAME, sampling_defaults
from tokenspeed.models.gguf import PlainGGUFReader, default_model_path, is_gguf
from tokenspeed.models.hub import resolve_model
from tokenspeed.models.fp8_layers import quantized_to_fp8
from tokenspeed.models.weight_only import quantized_to_int4
from tokenspeed.models.loader import load
from tokenspeed.execution.sampling_params import SamplingParams
from tokenspeed.tokenizer import Tokenizer, load_tokenizer
from tokenspeed.tokenizer.hf_dir import TOKENIZER_JSON_ONLY, missing_tokenizer_json

log = logging.getLogger(__name__)


def resolved(source, revision: str | None = None):
    """A path or Hugging Face model id as the local checkpoint it names (an id through the
    hub's cache); a model or tokenizer object, or None, as it is."""
    return str(resolve_model(source, revision)) if isinstance(source, (str, Path)) else source


def model_path(model, revision: str | None = None):
    """``ts.LLM``'s model argument as a checkpoint: None is the embedded default model, a
    file with no versions for ``revision`` to choose between."""
    if model is not None:
        return resolved(model, revision)
    if revision is not None:
        raise ValueError(f"revision={revision!r} selects a version of a Hugging Face model id; no "
                         f"model was given, and the embedded default model has no revisions")
    return default_model_path()


def gguf_reader(model):
    """The GGUF file opened once, for the model and its tokenizer to read one parse."""
    return PlainGGUFReader(model) if isinstance(model, (str, Path)) and is_gguf(model) and \
        Path(model).is_file() else None


def as_model(model, dtype, device, reader=None, quantization: str | None = None):
    """The model on ``device``, quantized at load if asked (``quantization``: fp8, int4)."""
    model = _loaded(model, dtype, device, reader, quantization)
    quantize = {"fp8": quantized_to_fp8, "int4": quantized_to_int4}.get(quantization)
    return quantize(model) if quantize else model


def _loaded(model, dtype, device, reader, quantization):
    if isinstance(model, (str, Path)):
        return load(model, dtype=dtype, device=device, gguf_reader=reader,
                    **kept_blocks(model, device, quantization))
    if not hasattr(model, "config"):
        raise TypeError(f"expected a checkpoint path or a tokenspeed model, got {type(model).__name__}")
    return model.to(device=device, dtype=dtype).eval() if dtype else model.to(device).eval()


def kept_blocks(model, device, quantization: str | None) -> dict:
    """``load``'s GGUF arguments. On the CPU a GGUF file's layers stay in the block formats
    the CPU's kernels read (``cpu_blocks``: the file's weights, a quarter to an eighth of
    float32's bytes, which bound a decode step's time, and float32 products), unless
    ``quantization`` asks to quantize anew (from dequantized weights). Elsewhere, or where
    the kernels do not build (said in one log line), GGUF weights are dequantized at load."""
    if torch.device(device).type != "cpu" or quantization is not None or not is_gguf(model):
        return {}
    if not cpu_blocks.available():
        log.warning("GGUF weights dequantized to float32 at load: the CPU's block kernels are not built (%s)",
                    cpu_blocks.unavailable_reason())
        return {}
    return {"quantized": True}   # the block formats the loader keeps are those cpu_blocks reads


def tokenizer_of(tokenizer, model, reader=None) -> Tokenizer | None:
    """The tokenizer asked for, else the model path's if it brings one (a directory of
    weights alone serves token-id prompts only)."""
    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    if tokenizer is not None:
        return load_tokenizer(tokenizer)
    path = tokenizer_path(model) if isinstance(model, (str, Path)) else None
    if path is None and (why := no_tokenizer_reason(model)):
        log.warning("%s: %s, so this model takes token-id prompts alone; for text, pass tokenizer=<a directory "
                    "or model id with a tokenizer.json>", why, TOKENIZER_JSON_ONLY)
    return None if path is None else load_tokenizer(path, reader)


def no_tokenizer_reason(model) -> str | None:
    """Why the model path brings no tokenizer though it holds tokenizer files (tokenizer.model
    but no tokenizer.json, ...); None where it brings one, or holds none (weights alone)."""
    return missing_tokenizer_json(model) if isinstance(model, (str, Path)) and Path(model).is_dir() else None


def tokenizer_path(model: str | Path) -> str | None:
    """The model path, if it brings a tokenizer (a directory of weights alone does not)."""
    path = Path(model)
    return None if path.is_dir() and not (path / "tokenizer.json").is_file() else str(model)


def sampling_defaults_of(model) -> dict:
    """``model``'s generation_config.json settings, checked as ``SamplingParams`` (a bad
    value is refused naming the file)."""
    defaults = sampling_defaults(model)
    try:
        SamplingParams(**defaults)
    except ValueError as exc:
        raise ValueError(f"{Path(model) / FILE_NAME}: {exc}") from exc
    return defaults
