"""A Hugging Face checkpoint directory (config.json + safetensors) as the loader reads it.

Every file is read with an error that names it (``ModelFileError``): a config.json that is
not a JSON object, a field of the wrong type, a truncated or foreign safetensors file, an
index naming a shard that is not there, a tensor stored in two files, a config whose layers
or vocabulary the tensors' headers do not hold. Tied embeddings follow transformers: a
checkpoint that holds an ``lm_head.weight`` distinct from the embedding keeps both,
whatever ``tie_word_embeddings`` says. A multimodal checkpoint is read as its language
model (``text_part``).
"""

import contextlib
import json
import re
from pathlib import Path

import attrs
import torch
from safetensors import SafetensorError, safe_open

from tokenspeed.models.config import ModelConfig, eos_ids
from tokenspeed.models.config_values import RUNNABLE_DTYPES, check_dtype
from tokenspeed.models.errors import ModelFileError
from tokenspeed.models.fp8_checkpoint import stored_tensors
from tokenspeed.models.fp8_scheme import Fp8Scheme, fp8_scheme
from tokenspeed.models.text_part import TextPart, loaded_name, text_part

EMBEDDING, LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"
FP8_SCALES = (".weight_scale", ".weight_scale_inv")
TENSOR_DTYPES = tuple(getattr(torch, name) for name in RUNNABLE_DTYPES)


@attrs.frozen
class HFCheckpoint:
    """An opened directory: the config it describes (tying as transformers resolves it),
    the dtype ``dtype=None`` loads it in, its safetensors files and, for an FP8
    checkpoint, how its FP8 matrices are scaled; ``text``: where a multimodal checkpoint
    holds its language model."""
    config: ModelConfig
    dtype: torch.dtype
    files: tuple[Path, ...]
    fp8: Fp8Scheme | None = None
    text: TextPart | None = None

    def tensors(self):
        """(name, tensor) pairs of what the model reads, file after file, named as it names
        them (FP8 scales as our layers hold them)."""
        pairs = (pair for file in self.files for pair in read_tensors(file, self.fp8 is not None, self.loaded_name))
        return stored_tensors(pairs) if self.fp8 else pairs

    def fp8_weights(self) -> list[str]:
        """The names of the matrices stored in FP8, read from the files' headers."""
        names = []
        for file in self.files:
            with opened(file) as f:
                names += [ours for n in f.keys()
                          if (ours := self.loaded_name(n)) is not None and f.get_slice(n).get_dtype() == "F8_E4M3"]
        return names

    def loaded_name(self, name: str) -> str | None:
        return loaded_name(name, self.text, self.config.hybrid is not None)


def open_dir(path) -> HFCheckpoint:
    """Reads config.json (and generation_config.json) and finds the safetensors files;
    the tensors are read by ``tensors()``."""
    path = Path(path)
    hf = read_hf_config(path)
    text = text_part(hf)
    hf = _text_config(path, hf, text) if text is not None else hf
    files = safetensors_files(path)
    _check_sizes(path / "config.json", hf, stored_shapes(files), "model." if text is None else text.prefix)
    config = read_config(path, hf)
    if config.tie_word_embeddings and _distinct_lm_head(files, text):
        config = attrs.evolve(config, tie_word_embeddings=False)
    fp8 = fp8_scheme(hf["quantization_config"]) if hf.get("quantization_config") else None
    return HFCheckpoint(config, getattr(torch, check_dtype(hf) or "float32"), tuple(files), fp8, text)


def stored_shapes(files: list[Path]) -> dict[str, tuple[int, ...]]:
    """Each stored tensor's shape, from the files' headers; a tensor stored in two files is
    refused (which copy a model reads would depend on the order the files are read in)."""
    shapes, where = {}, {}
    for file in files:
        with opened(file) as f:
            for name in f.keys():
                if name in where:
                    raise ModelFileError(file, f"tensor {name} is also stored in {where[name].name}: a "
                                               f"checkpoint stores each tensor once (a file left from another save?)")
                where[name], shapes[name] = file, tuple(f.get_slice(name).get_shape())
    return shapes


def _check_sizes(config_file: Path, hf: dict, shapes: dict, prefix: str) -> None:
    """The config's layer count and vocabulary against the tensors' headers, before a model
    of the config's size is built: ``num_hidden_layers=10**9`` would be built (and run out of
    memory) before the missing tensors could be named."""
    layers = {int(m[1]) for name in shapes if (m := re.match(re.escape(prefix) + r"layers\.(\d+)\.", name))}
    stored = max(layers) + 1 if layers else 0
    count = hf.get("num_hidden_layers")
    if isinstance(count, int) and count > stored:
        raise ModelFileError(config_file, f"num_hidden_layers={count}, but the checkpoint's tensors hold "
                                          f"{stored} layers ({prefix}layers.N.*)")
    rows, vocab = shapes.get(prefix + EMBEDDING.removeprefix("model."), (None,))[0], hf.get("vocab_size")
    if isinstance(vocab, int) and rows is not None and vocab != rows:
        raise ModelFileError(config_file, f"vocab_size={vocab}, but the checkpoint's embedding "
                                          f"({prefix}embed_tokens.weight) has {rows} rows")


def _text_config(path: Path, hf: dict, text: TextPart) -> dict:
    try:
        return text.config(hf)
    except ValueError as exc:
        raise ModelFileError(path / "config.json", str(exc)) from exc


def read_json(file: Path) -> dict:
    """A JSON object (the field names of a config or an index)."""
    try:
        value = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelFileError(file, f"not valid JSON ({exc})") from exc
    except OSError as exc:   # a directory of that name, a file not readable
        raise ModelFileError(file, f"cannot be read ({exc.strerror or exc})") from exc
    if not isinstance(value, dict):
        raise ModelFileError(file, f"expected a JSON object of fields, found a {type(value).__name__}")
    return value


def read_hf_config(path) -> dict:
    """config.json's fields, as written."""
    config_file = Path(path) / "config.json"
    if Path(path).is_file():
        raise FileNotFoundError(f"{path}: neither a model directory (with config.json) nor a GGUF file")
    if not config_file.exists():
        raise FileNotFoundError(f"{config_file} not found: expected a Hugging Face model directory"
                                f"{_gguf_files(Path(path))}")
    return read_json(config_file)


def _gguf_files(path: Path) -> str:
    """The GGUF files a directory without config.json holds (a GGUF repository's snapshot,
    fetched with ``hf download REPO FILE.gguf``), each a model to be named by its path."""
    found = sorted(f.name for f in path.glob("*.gguf"))
    if not found:
        return ""
    shown = ", ".join(found[:4]) + (f" and {len(found) - 4} more" if len(found) > 4 else "")
    return f" (it holds GGUF files, {shown}: a GGUF model is loaded by its file's path, {path / found[0]})"


def read_config(path, hf: dict | None = None) -> ModelConfig:
    """config.json (``hf``: its fields, already read), with the end-of-sequence ids of
    generation_config.json added (as transformers' generate stops on those)."""
    config_file, generation = Path(path) / "config.json", Path(path) / "generation_config.json"
    hf = read_hf_config(path) if hf is None else hf
    try:
        config = ModelConfig.from_hf(hf)
    except ValueError as exc:
        raise ModelFileError(config_file, str(exc)) from exc
    if generation.exists():
        extra = _generation_eos_ids(generation)
        try:
            config = attrs.evolve(config, eos_token_ids=tuple(dict.fromkeys(config.eos_token_ids + extra)))
        except ValueError as exc:
            raise ModelFileError(generation, str(exc)) from exc
    return config


def _generation_eos_ids(file: Path) -> tuple[int, ...]:
    ids = eos_ids(read_json(file))
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ModelFileError(file, f"eos_token_id={list(ids)} is not valid: expected token ids "
                                   f"(integers >= 0)")
    return ids


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        return _shards(index)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}{_other_weights(path)}")
    return files


def _other_weights(path: Path) -> str:
    """What a directory without safetensors holds instead (PyTorch pickles, as older saves
    and ``safe_serialization=False`` wrote them), named with the way to a readable copy:
    "no safetensors" alone read as if the weights were missing."""
    found = sorted(f.name for pattern in ("*.bin", "*.pt", "*.pth") for f in path.glob(pattern)
                   if f.name != "training_args.bin")
    if not found:
        return ""
    shown = ", ".join(found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
    return (f" (it holds PyTorch weights, {shown}: tokenspeed reads safetensors only; save a copy with "
            f"transformers' save_pretrained, which writes safetensors)")


def _shards(index: Path) -> list[Path]:
    weight_map = read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(s, str) for s in weight_map.values()):
        raise ModelFileError(index, "expected a weight_map object of tensor name -> shard file name")
    outside = sorted({s for s in weight_map.values() if Path(s).name != s or s in (".", "..")})
    if outside:
        raise ModelFileError(index, f"names shard(s) {outside} that are not file names in its directory")
    shards = [index.parent / s for s in sorted(set(weight_map.values()))]
    missing = [s.name for s in shards if not s.is_file()]
    if missing:
        raise ModelFileError(index, f"names shard(s) {missing} that are not in {index.parent}")
    return shards


@contextlib.contextmanager
def opened(file: Path):
    """``safe_open``, its errors (a truncated file, a foreign one) naming the file."""
    try:
        with safe_open(str(file), framework="pt") as f:
            yield f
    except SafetensorError as exc:
        raise ModelFileError(file, f"not a readable safetensors file (truncated or corrupt: {exc})") from exc
    except OSError as exc:   # a directory of that name, a file not readable
        raise ModelFileError(file, f"cannot be read as a safetensors file ({exc})") from exc


def read_tensors(file: Path, fp8: bool = False, read=None):
    """(name, tensor) pairs of one safetensors file, each of a dtype the engine runs (and
    FP8, where the config declares an FP8 scheme); ``read`` maps a stored name to the name
    the model loads it by, or to None for a tensor left unread (default: all, as stored)."""
    with opened(file) as f:
        for name in f.keys():
            ours = name if read is None else read(name)
            if ours is not None:
                tensor = _runnable(f.get_tensor(name), name, file, fp8)
                yield ours, _checked_scale(tensor, name, file) if fp8 and name.endswith(FP8_SCALES) else tensor


def _runnable(tensor: torch.Tensor, name: str, file: Path, fp8: bool) -> torch.Tensor:
    """A tensor of another dtype (FP8 without a declared scheme, integers) holds values
    that a plain cast to the model's dtype would change (FP8 weights need their scales)."""
    if tensor.dtype not in TENSOR_DTYPES and not (fp8 and tensor.dtype == torch.float8_e4m3fn):
        raise ModelFileError(file, f"tensor {name} is stored as {str(tensor.dtype).removeprefix('torch.')}; "
                                   f"tokenspeed reads {', '.join(RUNNABLE_DTYPES)} tensors")
    return tensor


def _checked_scale(scale: torch.Tensor, name: str, file: Path) -> torch.Tensor:
    """An FP8 weight's scales, each finite and not negative (a NaN one made every logit NaN,
    and the engine then wrote token 0 without complaint); zero scales an all-zero row."""
    values = scale.float().flatten()
    bad = values[~(values >= 0) | values.isinf()]   # NaN is not >= 0
    if len(bad):
        raise ModelFileError(file, f"FP8 scale {name} holds {bad[0].item()}: expected finite scales >= 0")
    return scale


def _distinct_lm_head(files: list[Path], text: TextPart | None) -> bool:
    """Whether the checkpoint holds both the embedding and an ``lm_head.weight`` that is
    not equal to it: transformers then leaves the two untied (``tie_weights``)."""
    embedding = EMBEDDING if text is None else text.stored_name(EMBEDDING)
    found = {}
    for file in files:
        with opened(file) as f:
            found.update({n: f.get_tensor(n) for n in (embedding, LM_HEAD) if n in f.keys()})
    return len(found) == 2 and not torch.equal(found[embedding], found[LM_HEAD])
