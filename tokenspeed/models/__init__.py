from tokenspeed.models.config import ModelConfig
from tokenspeed.models.llama import LlamaForCausalLM
from tokenspeed.models.loader import build, load

__all__ = ["LlamaForCausalLM", "ModelConfig", "build", "load"]
