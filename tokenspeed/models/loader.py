"""Load a Hugging Face checkpoint directory (config.json + safetensors), or a GGUF file
(read by ``tokenspeed.models.gguf`` as the same Hugging Face tensors), into our model.

Tensors are read straight into freshly allocated parameters (the model is built on the
meta device first, so nothing is initialised twice).
"""

import torch
from tqdm import tqdm

from tokenspeed.ir.weights import BlockWeight
from tokenspeed.models import gguf as gguf_file
from tokenspeed.models.block_layers import gather_q8_0_head
from tokenspeed.models.block_plan import plan, stored_matrices, swap_layers
from tokenspeed.models.config import DEEPSEEK, ModelConfig
from tokenspeed.models.deepseek import DeepseekForCausalLM
from tokenspeed.models.config_values import RUNNABLE_DTYPES
from tokenspeed.models.errors import ModelFileError
from tokenspeed.models.fp8_checkpoint import fitted_scale, fp8_layers, kv_scale_entry, part_rows, swap_fp8_layers
from tokenspeed.models.kv_scales import kv_scales, set_kv_scales
from tokenspeed.models.hf_checkpoint import EMBEDDING, LM_HEAD, TENSOR_DTYPES, open_dir
from tokenspeed.models.hub import resolve_model
from tokenspeed.models.llama import LlamaForCausalLM
from tokenspeed.models.qwen3_next import Qwen3NextForCausalLM
from tokenspeed.models.stacking import part_names, stacked_layers, stacked_parts, stacked_sizes
from tokenspeed.models.moe_checkpoint import checkpoint_name, expected_keys, expert_piece, our_name, stored_name
from tokenspeed.models.param_shapes import shape_origin

IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class CheckpointMismatchError(ValueError):
    """The checkpoint's tensors are not the ones its config describes (missing, extra, or
    of another shape)."""


def build(config: ModelConfig, dtype=torch.float32, device="cpu") -> LlamaForCausalLM:
    """An uninitialised model: parameters allocated (rotary tables compute themselves)."""
    return _allocated(_on_meta(config), dtype, device)


def model_class(config: ModelConfig) -> type:
    """The definition that traces ``config``'s architecture."""
    if config.architecture in DEEPSEEK:
        return DeepseekForCausalLM
    return Qwen3NextForCausalLM if config.hybrid is not None else LlamaForCausalLM


def _on_meta(config: ModelConfig) -> LlamaForCausalLM:
    with torch.device("meta"):
        return model_class(config)(config)


def _allocated(model: LlamaForCausalLM, dtype, device) -> LlamaForCausalLM:
    """The dtype set on the meta device, then the memory: allocated the other way round, a
    bfloat16 model first took float32's (Qwen3-30B-A3B's 57 GiB passed through 114 and did
    not load on an 80 GB card)."""
    model = model.to(dtype)
    _check_fits(model, torch.device(device))
    model = model.to_empty(device=device)
    if model.config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model


def _check_fits(model: LlamaForCausalLM, device: torch.device) -> None:
    """A model larger than the GPU's free memory is refused before any of it is allocated,
    with both sizes named (the allocator's out-of-memory error, part of the way in, names
    neither the model's size nor the card's)."""
    if device.type != "cuda":
        return
    free, total = torch.cuda.mem_get_info(device)
    needed = _held_bytes(model)
    if needed > free:
        raise ValueError(f"the model's weights take {needed / 2**30:.1f} GiB; {device} has "
                         f"{free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB")


def _held_bytes(model: LlamaForCausalLM) -> int:
    """The bytes of a model's parameters and buffers (each once: ``parameters()`` counts a
    tied output head with the embedding)."""
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


def load(path, dtype=None, device="cpu", gguf_reader=None, revision=None,
         quantized: bool = False) -> LlamaForCausalLM:
    """A Hugging Face directory, a ``.gguf`` file (``gguf_reader``: that file already
    opened with ``gguf.GGUFReader``), or a Hugging Face model id (``owner/name``, at
    ``revision``; see ``hub.resolve_model``). ``dtype=None`` keeps the directory's
    ``torch_dtype``/``dtype`` (float32 if absent; for GGUF see ``gguf.default_dtype``),
    except that a GPU runs float32 as bfloat16 (``run_dtype``). ``quantized`` (GGUF): keep
    the weights of the block formats kernels read in their blocks (``block_plan``).
    ``ts.LLM`` asks for it on the CPU (``api/model_source.kept_blocks``); not yet on a GPU:
    there a Q8_0 model's tokens with its blocks still differ from the dequantized model's
    (tests/test_gguf_blocks.py, GPU). FP8 checkpoints keep their FP8 layers on every
    device."""
    path = resolve_model(path, revision)
    dtype = _dtype_argument(dtype)
    if gguf_file.is_gguf(path):
        return _load_gguf(path, dtype, device, gguf_reader, quantized)
    if quantized:
        raise ValueError(f"quantized=True: only GGUF files keep quantized weights; {path} is not one")
    checkpoint = open_dir(path)
    return _filled(_allocated(_with_fp8_layers(checkpoint), dtype or run_dtype(checkpoint.dtype, device), device),
                   checkpoint, path)


def run_dtype(stored: torch.dtype, device) -> torch.dtype:
    """The dtype ``dtype=None`` runs a checkpoint stored in ``stored`` in: as stored, but
    bfloat16 for float32 on a GPU (vLLM's ``auto``: tensor cores, half the bytes read)."""
    return torch.bfloat16 if stored == torch.float32 and torch.device(device).type == "cuda" else stored


def _dtype_argument(dtype) -> torch.dtype | None:
    """A torch dtype, or its name (as ``ts.LLM`` takes it)."""
    if isinstance(dtype, str) and dtype.removeprefix("torch.") in RUNNABLE_DTYPES:
        return getattr(torch, dtype.removeprefix("torch."))
    if dtype is not None and dtype not in TENSOR_DTYPES:
        raise ValueError(f"dtype={dtype!r}: tokenspeed runs {', '.join(RUNNABLE_DTYPES)} (a torch dtype or its name)")
    return dtype


def _load_gguf(path, dtype, device, reader, quantized: bool) -> LlamaForCausalLM:
    """On a GPU, a kept Q8_0 head is regathered: its quants read 16 bytes a load."""
    checkpoint = gguf_file.open_gguf(path, reader)
    model, kept = _with_block_layers(checkpoint, quantized)
    model = _filled(_allocated(model, dtype or run_dtype(checkpoint.dtype, device), device), checkpoint, path, kept)
    return gather_q8_0_head(model) if quantized and torch.device(device).type == "cuda" else model


def _with_block_layers(checkpoint, keep_blocks: bool) -> tuple[LlamaForCausalLM, frozenset[str]]:
    """The model on the meta device with, if ``keep_blocks``, the layers ``block_plan``
    keeps in blocks swapped in; and the checkpoint names of the weights read as blocks."""
    model = _on_meta(checkpoint.config)
    if not keep_blocks:
        return model, frozenset()
    block_plan = plan(model, stored_matrices(checkpoint.reader))
    return swap_layers(model, block_plan), block_plan.kept


def _with_fp8_layers(checkpoint) -> LlamaForCausalLM:
    """The model on the meta device, its layers stored in FP8 (if any) ``Fp8Linear``s."""
    model = _on_meta(checkpoint.config)
    if checkpoint.fp8 is None:
        return model
    return swap_fp8_layers(model, fp8_layers(model, checkpoint.fp8_weights()), checkpoint.fp8)


def _filled(model, checkpoint, path, kept: frozenset[str] = frozenset()) -> LlamaForCausalLM:
    """``model`` with ``checkpoint``'s tensors (those named in ``kept`` as their blocks); a
    mismatch names the checkpoint ``path``."""
    try:
        load_state_dict(model, checkpoint.tensors(kept) if kept else checkpoint.tensors())
    except CheckpointMismatchError as exc:
        raise ModelFileError(path, str(exc)) from exc
    return model.eval()


def load_state_dict(model: torch.nn.Module, state) -> None:
    """Load Hugging Face tensors (a dict, or (name, tensor) pairs) into ``model``."""
    params = dict(model.named_parameters(remove_duplicate=False))
    unexpected, loaded, sums = [], set(), {}
    pairs = state.items() if isinstance(state, dict) else state
    for name, tensor in tqdm(pairs, desc="loading weights", unit="tensor", disable=None, leave=False):
        if not name.endswith(IGNORED_SUFFIXES):
            sums[name] = _load_one(model, params, name, tensor, loaded, unexpected)
    _check_complete(model, loaded, unexpected)
    _check_finite({name: total for name, total in sums.items() if total is not None})


def _check_finite(sums: dict[str, torch.Tensor]) -> None:
    """Every loaded float tensor holds finite values (its float32 sum, read once for all: one
    NaN weight made every logit NaN, and sampling then wrote token 0 without complaint)."""
    finite = torch.stack(list(sums.values())).isfinite().tolist() if sums else []
    bad = [name for name, ok in zip(sums, finite) if not ok]
    if bad:
        raise CheckpointMismatchError(f"tensor {bad[0]} holds NaN or infinite values"
                                      f"{f' (and {len(bad) - 1} more tensors)' if len(bad) > 1 else ''}")


def _load_one(model, params, name, tensor, loaded: set, unexpected: list) -> torch.Tensor | None:
    """Copy one checkpoint tensor into its parameter or its slice of a stacked one; its sum
    as copied (``_copy``)."""
    entry = kv_scale_entry(name)
    if entry is not None and entry[0] < model.config.num_layers:   # read by an FP8 pool
        scales = kv_scales(model)
        scales[entry] = float(tensor)
        set_kv_scales(model, scales)
        return None
    tensor = model.loaded(name, tensor) if hasattr(model, "loaded") else tensor
    ours = our_name(name)
    if ours in params:
        loaded.update(expected_keys(ours, params[ours]) or [ours])
        return _copy(params[ours], tensor, name, model.config)
    piece = expert_piece(name)
    if piece is not None and piece.param in params and piece.expert < len(params[piece.param]):
        loaded.add(piece.key)
        return _copy(piece.target(params), tensor, name, model.config)
    for part, (stacked, index) in stacked_parts(model.config).items():
        target, own = name.replace(f".{part}.", f".{stacked}."), name.replace(f".{part}.", f".{stacked}.{part}.")
        if target != name and target in params:
            sizes = stacked_sizes(model.config, stacked, params[target].shape[0])
            parts = params[target].split(part_rows(params[target], sizes))
            loaded.add(f"{target}#{index}")
            return _copy(parts[index], tensor, name, model.config)
        if own != name and own in params:  # a part kept as its own layer (``BlockLinearParts``)
            loaded.add(own)
            return _copy(params[own], tensor, name, model.config)
    unexpected.append(name)
    return None


def _check_complete(model, loaded: set, unexpected: list) -> None:
    missing = sorted(_checkpoint_name(n, model.config) for n in _expected(model) - loaded - _tied(model, loaded))
    if missing or unexpected:
        raise CheckpointMismatchError(f"checkpoint does not match {model.config.architecture}: "
                         f"missing tensors {missing[:8]}{'...' if len(missing) > 8 else ''}, "
                         f"unexpected tensors {unexpected[:8]}{'...' if len(unexpected) > 8 else ''}")


def _expected(model) -> set[str]:
    """What a complete checkpoint fills: each parameter, each part of a stacked one, each
    expert's matrices (``moe_checkpoint``)."""
    expected = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        experts = expected_keys(name, param)
        stacked = name.split(".")[-2] if name.split(".")[-2] in stacked_layers(model.config) else None
        parts = len(stacked_sizes(model.config, stacked, param.shape[0])) if stacked else 0
        expected.update(experts or ([f"{name}#{i}" for i in range(parts)] if parts else [name]))
    return expected


def _tied(model, loaded: set) -> set[str]:
    """With tied embeddings either tensor fills both (transformers ties to whichever the
    checkpoint holds)."""
    pair = {EMBEDDING, LM_HEAD}
    return pair if model.config.tie_word_embeddings and pair & loaded else set()


def _checkpoint_name(expected: str, config: ModelConfig) -> str:
    """``...qkv_proj.weight#1`` -> ``...k_proj.weight``: name missing tensors as stored."""
    if ".experts." in expected:
        return checkpoint_name(expected, config.architecture)
    if "#" not in expected:
        return stored_name(expected, config.architecture)
    name, index = expected.split("#")
    stacked = name.split(".")[-2]
    return name.replace(f".{stacked}.", f".{part_names(config, stacked)[int(index)]}.")


def _copy(param: torch.Tensor, value, name: str, config: ModelConfig) -> torch.Tensor | None:
    """``value``: a tensor, a per-tensor FP8 scale (repeated over the channels it scales),
    or a ``BlockWeight`` whose blocks fill a block layer's weight. The float32 sum of what
    was copied, where it is in a float dtype (not blocks nor FP8), still on its device."""
    value = value.blocks if isinstance(value, BlockWeight) else fitted_scale(name, param, value)
    if param.shape != value.shape:
        raise CheckpointMismatchError(f"tensor {name}: checkpoint shape {tuple(value.shape)}, model "
                                      f"expects {tuple(param.shape)} ({shape_origin(config, name)})")
    with torch.no_grad():
        param.copy_(value)
        return param.sum(dtype=torch.float32) if param.dtype in TENSOR_DTYPES else None
