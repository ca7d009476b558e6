"""Compiling and building an engine are wired by name: every option past the leading
inputs is keyword-only, so a new or reordered one cannot shift another's value."""

import inspect

import pytest
import torch

import tokenspeed as ts
from tokenspeed import stages
from tokenspeed.models.random import TINY_LLAMA, random_model
from tokenspeed.execution.decode_runner import DecodeRunner
from tokenspeed.engine.core import Engine
from tokenspeed.execution.prefill_runner import PrefillRunner
from tokenspeed.execution.startup import build_runners

LEADING = [(Engine.__init__, ("self", "scheduler")),
           (stages.compile, ("prefill", "decode", "config")),
           (build_runners, ("programs", "kv_cache", "backend")),
           (DecodeRunner.__init__, ("self", "program", "kv_cache", "backend")),
           (PrefillRunner.__init__, ("self", "program", "kv_cache", "backend"))]


@pytest.mark.parametrize("function, leading", LEADING, ids=[f.__qualname__ for f, _ in LEADING])
def test_options_past_the_leading_inputs_are_keyword_only(function, leading):
    params = list(inspect.signature(function).parameters.values())
    assert tuple(p.name for p in params[:len(leading)]) == leading
    positional = [p.name for p in params[len(leading):] if p.kind is not inspect.Parameter.KEYWORD_ONLY]
    assert positional == []


def test_compile_refuses_its_options_by_position():
    traced = ts.trace(random_model(TINY_LLAMA))
    with pytest.raises(TypeError, match="positional"):
        ts.compile(traced.lower("prefill"), traced.lower("decode"), ts.CompileConfig(num_kv_pages=8), None)


def test_compile_refuses_programs_in_each_others_places():
    traced = ts.trace(random_model(TINY_LLAMA))
    prefill, decode = traced.lower("prefill"), traced.lower("decode")
    with pytest.raises(ValueError, match=r"the prefill argument is a 'decode' program; pass traced.lower\('prefill'\)"):
        ts.compile(decode, prefill, ts.CompileConfig(num_kv_pages=8))
    with pytest.raises(ValueError, match=r"the decode argument is a 'prefill' program"):
        ts.compile(prefill, prefill, ts.CompileConfig(num_kv_pages=8))
    with pytest.raises(ValueError, match=r"the decode argument is Traced"):
        ts.compile(prefill, traced, ts.CompileConfig(num_kv_pages=8))


@pytest.mark.parametrize("config", ["cpu", None, {"num_kv_pages": 8}])
def test_compile_refuses_a_config_that_is_not_one(config):
    traced = ts.trace(random_model(TINY_LLAMA))
    with pytest.raises(TypeError, match=r"config must be a ts.CompileConfig, got"):
        ts.compile(traced.lower("prefill"), traced.lower("decode"), config)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
def test_compile_for_cuda_without_a_gpu_is_refused_by_name():
    traced = ts.trace(random_model(TINY_LLAMA))
    with pytest.raises(ValueError, match=r"CompileConfig\(device='cuda'\), but no CUDA GPU is available here"):
        ts.compile(traced.lower("prefill"), traced.lower("decode"), ts.CompileConfig(device="cuda"))


@pytest.mark.parametrize("model", [None, "model.gguf", torch.nn.Linear(2, 2)], ids=["None", "a path", "a Linear"])
def test_trace_refuses_what_is_not_a_tokenspeed_model(model):
    with pytest.raises(TypeError, match=r"trace\(model\): expected a tokenspeed model .* ts.models.load\(path\)"):
        ts.trace(model)


def test_a_verify_window_holds_at_least_the_token_before_the_drafts():
    lowered = ts.trace(random_model(TINY_LLAMA)).lower("verify")
    with pytest.raises(ValueError, match="window"):
        stages.Verification(lowered, 0)


def test_an_op_may_not_declare_an_optional_argument_mutated():
    """torch 2.11 bumps the version of a mutated argument by its position in the call: an
    omitted optional one raised an IndexError at run time (outside inference mode)."""
    from tokenspeed.ir.ops import _op
    with pytest.raises(TypeError, match=r"tokenspeed::scratch declares optional arguments mutated: \['buf'\]"):
        @_op("scratch", mutates_args=("buf",))
        def scratch(x: torch.Tensor, buf: torch.Tensor | None = None) -> torch.Tensor:
            return x


def test_a_device_torch_does_not_know_is_named():
    with pytest.raises(ValueError, match=r"device='gpu' is not a device \(cpu, cuda, cuda:N\)"):
        ts.CompileConfig(device="gpu")
