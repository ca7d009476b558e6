"""tokenspeed: trace -> lower -> compile a Llama-family model, then serve it from a paged cache."""

from tokenspeed import models
from tokenspeed.ir import fused_ops  # noqa: F401 - registers the fused ops at import, not in a startup
from tokenspeed.ir.trace import Traced, trace
from tokenspeed.llm import LLM
from tokenspeed.sampling_params import RequestOutput, SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams", "Traced", "models", "trace"]
