from tokenspeed.models.config import ModelConfig
from tokenspeed.models.gguf import default_model_path
from tokenspeed.models.hub import resolve_model
from tokenspeed.models.llama import LlamaForCausalLM
from tokenspeed.models.loader import build, load

__all__ = ["LlamaForCausalLM", "ModelConfig", "build", "default_model_path", "load", "resolve_model"]
