"""tokenspeed: trace -> lower -> compile a Llama-family model, then serve it from a paged cache.

The public names load on first use (module ``__getattr__``), so ``tokenspeed --help`` and
other commands that never touch a model do not pay for importing torch.
"""

import importlib
from typing import TYPE_CHECKING

_HOMES = {"LLM": "tokenspeed.api.llm", "CompileConfig": "tokenspeed.execution.compile_config",
          "RequestOutput": "tokenspeed.execution.outputs", "SamplingParams": "tokenspeed.execution.sampling_params",
          "SpeculativeConfig": "tokenspeed.engine.speculative", "StructuredOutputs": "tokenspeed.structured",
          "Compiled": "tokenspeed.stages", "Lowered": "tokenspeed.stages", "Traced": "tokenspeed.stages",
          "compile": "tokenspeed.stages", "trace": "tokenspeed.stages"}
__all__ = sorted([*_HOMES, "models"])

if TYPE_CHECKING:
    from tokenspeed import models
    from tokenspeed.api.llm import LLM
    from tokenspeed.execution.compile_config import CompileConfig
    from tokenspeed.execution.outputs import RequestOutput
    from tokenspeed.execution.sampling_params import SamplingParams
    from tokenspeed.engine.speculative import SpeculativeConfig
    from tokenspeed.stages import Compiled, Lowered, Traced, compile, trace
    from tokenspeed.structured import StructuredOutputs


def __getattr__(name: str):
    if name == "models":
        return importlib.import_module("tokenspeed.models")
    if name not in _HOMES:
        raise AttributeError(f"module 'tokenspeed' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)


def __dir__() -> list[str]:
    return __all__
