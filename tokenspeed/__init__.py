"""tokenspeed: trace -> lower -> compile a Llama-family model, then serve it from a paged cache."""

from tokenspeed import models
from tokenspeed.entrypoints.llm import LLM
from tokenspeed.runtime.compile_config import CompileConfig
from tokenspeed.runtime.outputs import RequestOutput
from tokenspeed.runtime.sampling_params import SamplingParams
from tokenspeed.runtime.speculative import SpeculativeConfig
from tokenspeed.stages import Compiled, Lowered, Traced, compile, trace

__all__ = ["LLM", "CompileConfig", "Compiled", "Lowered", "RequestOutput", "SamplingParams",
           "SpeculativeConfig", "Traced", "compile", "models", "trace"]
