"""Random-weight models for tests, demos and benchmarks (no hub access is possible)."""

import torch

from tokenspeed.models.config import ModelConfig
from tokenspeed.models.llama import LlamaForCausalLM
from tokenspeed.models.stacking import STACKED_LAYERS, part_names, stacked_sizes
from tokenspeed.models.loader import build
from tokenspeed.models.moe_checkpoint import expected_keys, expert_tensors

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 512, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "max_position_embeddings": 512,
    "rope_theta": 10000.0, "tie_word_embeddings": False, "dtype": "float32",
}


def init_random(model: LlamaForCausalLM, seed: int = 0, std: float = 0.02) -> LlamaForCausalLM:
    """Normal(0, std) matrices and unit norms, as transformers initialises Llama. The numbers
    are drawn on the model's device (a 30B-parameter shape would take minutes on the host),
    so one seed gives a model built on the GPU other weights than one built on the CPU."""
    generators = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                if p.device not in generators:
                    generators[p.device] = torch.Generator(device=p.device).manual_seed(seed)
                gen = generators[p.device]
                p.copy_(torch.randn(p.shape, generator=gen, device=p.device) * std)
    return model


def random_model(hf_config: dict, dtype=torch.float32, device="cpu", seed: int = 0) -> LlamaForCausalLM:
    return init_random(build(ModelConfig.from_hf(hf_config), dtype, device), seed).eval()


def hf_state_dict(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """Our state dict with stacked projections (and experts) split back into Hugging Face names."""
    state = {}
    for name, tensor in model.state_dict().items():
        if expected_keys(name, tensor) is not None:
            state.update(expert_tensors(name, tensor, model.config.architecture))
            continue
        stacked = next((s for s in STACKED_LAYERS if f".{s}." in name), None)
        if stacked is None:
            state[name] = tensor.contiguous()
            continue
        sizes = stacked_sizes(model.config, stacked, tensor.shape[0])
        for part, piece in zip(part_names(model.config, stacked), tensor.split(sizes), strict=True):
            state[name.replace(f".{stacked}.", f".{part}.")] = piece.contiguous()
    return state
