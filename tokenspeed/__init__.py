"""tokenspeed: trace -> lower -> compile a Llama-family model, then serve it from a paged cache."""

from tokenspeed import models
from tokenspeed.ir.trace import Traced, trace
from tokenspeed.llm import LLM
from tokenspeed.sampling_params import RequestOutput, SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams", "Traced", "models", "trace"]
