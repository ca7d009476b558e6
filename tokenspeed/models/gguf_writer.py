"""Write a llama-architecture GGUF file as llama.cpp's converter writes one, from a model's
Hugging Face state dict, its matrices in one chosen GGUF type.

Tests and benchmarks need GGUF files of models that exist only as random weights (nothing
can be downloaded), laid out as the files users run: tensor names from
``gguf.get_tensor_name_map``, the rows of ``q_proj``/``k_proj`` permuted as the converter's
``LlamaModel.permute`` does, Llama 3 rope scaling as per-frequency divisors
(``rope_freqs.weight``), vectors (norms, biases) kept F32, no ``output.weight`` when the
head is tied.

Matrices of the types ``gguf.quants.quantize`` writes are the weights quantized. It has
no quantizer for the K-quants: their matrices are random blocks of the right size (every
byte below 0x3c, so any float16 scale in them is finite and below one), not the weights.
That serves a benchmark, which reads the same bytes and runs the same kernels whatever
the values, and tests that compare against ``gguf``'s dequantization of the same bytes;
the tokens of such a file say nothing about the model it came from.
"""

from collections.abc import Mapping

import gguf
import numpy as np
import torch

from tokenspeed.models.config import ModelConfig
from tokenspeed.models.gguf import ROPE_FREQS
from tokenspeed.models.layers import rope_inv_freq

Q = gguf.GGMLQuantizationType
S, U, F = gguf.GGUFValueType.STRING, gguf.GGUFValueType.UINT32, gguf.GGUFValueType.FLOAT32
QUANTIZED_TYPES = (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1)
RANDOM_BLOCK_TYPES = (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K)
PERMUTED = {"q_proj": "num_heads", "k_proj": "num_kv_heads"}  # part -> the config's head count


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's ``LlamaModel.permute`` (Hugging Face rows -> GGUF rows)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write(path, arch: str, meta: dict, tensors: dict) -> str:
    """A GGUF file: ``meta`` keys without the ``{arch}.`` prefix (value, type), and
    ``tensors`` as name -> float32 array or (raw bytes, type)."""
    writer = gguf.GGUFWriter(str(path), arch)
    for key, (value, vtype) in meta.items():
        writer.add_key_value(key if key.startswith(("tokenizer.", "general.")) else f"{arch}.{key}",
                             value, vtype)
    for name, tensor in tensors.items():
        raw, qtype = tensor if isinstance(tensor, tuple) else (tensor, None)
        writer.add_tensor(name, raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def metadata(layers, hidden, ffn, heads, kv_heads, head_dim, vocab, theta=10000.0, context=256,
             eps=1e-6, eos: int | None = None) -> dict:
    """The ``llama`` keys of a model's shape (``eos``: the end-of-sequence token, if any)."""
    meta = {"block_count": (layers, U), "context_length": (context, U), "embedding_length": (hidden, U),
            "feed_forward_length": (ffn, U), "attention.head_count": (heads, U),
            "attention.head_count_kv": (kv_heads, U), "attention.key_length": (head_dim, U),
            "attention.value_length": (head_dim, U), "rope.dimension_count": (head_dim, U),
            "rope.freq_base": (theta, F), "attention.layer_norm_rms_epsilon": (eps, F),
            "vocab_size": (vocab, U)}
    return meta if eos is None else {**meta, "tokenizer.ggml.eos_token_id": (eos, U)}


def config_metadata(config: ModelConfig) -> dict:
    """``metadata`` of ``config``, with its Llama 3 rope scaling's original context."""
    c = config
    meta = metadata(c.num_layers, c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads,
                    c.head_dim, c.vocab_size, c.rope_theta, c.max_position_embeddings, c.rms_norm_eps,
                    c.eos_token_ids[0] if c.eos_token_ids else None)
    if c.rope_scaling is None:
        return meta
    return {**meta, "rope.scaling.original_context_length":
            (c.rope_scaling.original_max_position_embeddings, U)}


def encode(w: np.ndarray, qtype):
    """Matrices quantized to ``qtype``; vectors (norms, biases) stay F32 as llama.cpp keeps them."""
    return w if qtype == Q.F32 or w.ndim == 1 else (gguf.quants.quantize(w, qtype), qtype)


def random_blocks(shape, qtype, seed: int) -> np.ndarray:
    """Random bytes of a ``shape`` tensor of ``qtype``, every byte below 0x3c so that any
    float16 / bfloat16 scale in them is finite and small."""
    byte_shape = gguf.quants.quant_shape_to_byte_shape(shape, qtype)
    return np.random.default_rng(seed).integers(0, 0x3C, size=byte_shape, dtype=np.uint8)


def rope_freqs(config: ModelConfig) -> dict:
    """``rope_freqs.weight`` (plain / scaled inverse frequencies) where ``config`` scales rope."""
    if config.rope_scaling is None:
        return {}
    plain = rope_inv_freq(config.head_dim, config.rope_theta, None)
    scaled = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
    return {ROPE_FREQS: (plain / scaled).numpy().astype(np.float32)}


def write_llama(path, config: ModelConfig, state: Mapping[str, torch.Tensor], qtype) -> str:
    """``state`` (Hugging Face names, any device and float dtype) as a ``llama`` file of
    ``config`` with every matrix in ``qtype`` (see the module docstring for the K-quants)."""
    qtype = _writable(qtype, config)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_layers)
    tensors = {}
    for seed, (name, tensor) in enumerate(state.items()):
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        stored = _stored(name, tensor, config, qtype, seed)
        tensors[names.get_name(name, try_suffixes=(".weight", ".bias"))] = stored
    return write(path, "llama", config_metadata(config), {**tensors, **rope_freqs(config)})


def _writable(qtype, config: ModelConfig):
    qtype = Q[qtype] if isinstance(qtype, str) else Q(qtype)
    if qtype not in QUANTIZED_TYPES + RANDOM_BLOCK_TYPES:
        raise ValueError(f"GGUF type {qtype.name} cannot be written; writable: "
                         f"{', '.join(t.name for t in QUANTIZED_TYPES + RANDOM_BLOCK_TYPES)}")
    if config.architecture != "LlamaForCausalLM":
        raise ValueError(f"write_llama writes LlamaForCausalLM models; got {config.architecture}")
    return qtype


def _stored(name: str, tensor: torch.Tensor, config: ModelConfig, qtype, seed: int):
    """A tensor as the file stores it: a vector F32, a matrix in ``qtype``."""
    if tensor.dim() > 1 and qtype in RANDOM_BLOCK_TYPES:
        return random_blocks(tuple(tensor.shape), qtype, seed), qtype
    w = tensor.detach().to("cpu", torch.float32).numpy()
    part = name.split(".")[-2]
    if part in PERMUTED:
        w = llama_cpp_permute(w, getattr(config, PERMUTED[part]))
    return encode(w, qtype)
