"""The one request check refuses with a ``RefusedRequest`` carrying the field, the bad value
and the limit it breaks, which the CLI renders as one line; an internal fault is an
``InternalError`` that the CLI lets through with its traceback."""

import pickle
import subprocess
import sys

import attrs
import pytest
from hypothesis import given, strategies as st

import tokenspeed as ts
from tokenspeed.cli.main import main
from tokenspeed.errors import InternalError, RefusedRequest
from tokenspeed.scheduling.block_allocator import BlockAllocator
from tokenspeed.scheduling.prompt_limits import PromptLimits, check_request

from text_models import text_model_dir

LIMITS = PromptLimits(vocab_size=100, max_model_len=64, page_size=4, usable_pages=10, eos_token_ids=(2,))


def refusal(prompt, has_tokenizer=True, **params) -> RefusedRequest:
    with pytest.raises(RefusedRequest) as refused:
        check_request(LIMITS, 3, tuple(prompt), ts.SamplingParams(**params), has_tokenizer=has_tokenizer)
    return refused.value


@pytest.mark.parametrize("prompt, params, has_tokenizer, field, value, limit", [
    ([], {}, True, "prompt", 0, 1),
    ([5, 100, 6], {}, True, "prompt", 100, 100),
    ([5, -2], {}, True, "prompt", -2, 100),
    ([5], {"stop_token_ids": [7, 250]}, True, "stop_token_ids", 250, 100),
    ([5] * 10, {"max_tokens": 60}, True, "max_tokens", 70, 64),
    ([5] * 10, {"max_tokens": 40}, True, "max_tokens", 13, 10),
    ([5], {"stop": ["x"]}, False, "stop", ("x",), None),
    ([5] * 64, {"max_tokens": None}, True, "prompt", 64, 39),   # 10 usable pages hold 40 tokens
    ([5] * 40, {"max_tokens": None}, True, "prompt", 40, 39),
    ([5], {"min_tokens": 2, "allowed_token_ids": [2]}, True, "min_tokens", 2, 0),   # the end of sequence alone
    ([5], {"min_tokens": 1, "allowed_token_ids": [2, 9], "stop_token_ids": [9]}, True, "min_tokens", 1, 0),
])
def test_a_refusal_carries_its_field_value_and_limit(prompt, params, has_tokenizer, field, value, limit):
    refused = refusal(prompt, has_tokenizer, **params)
    assert (refused.field, refused.value, refused.limit) == (field, value, limit)
    assert isinstance(refused, ValueError)


@pytest.mark.parametrize("params", [{"min_tokens": 2, "allowed_token_ids": [2, 9]},
                                    {"min_tokens": 2, "allowed_token_ids": [2], "ignore_eos": True},
                                    {"allowed_token_ids": [2]}])
def test_allowed_tokens_that_min_tokens_leaves_one_of_are_served(params):
    check_request(LIMITS, 0, (5,), ts.SamplingParams(**params), has_tokenizer=True)


def test_min_tokens_over_allowed_end_tokens_alone_is_refused_by_the_llm_and_the_engine():
    """By the door (``LLM``, whose limits carry the engine's end-of-sequence ids) and by the
    engine's own ``add``: a token outside the allowed ones was sampled (a fault probe found it)."""
    llm = ts.LLM(text_model_dir(), page_size=4, max_model_len=32)
    params = ts.SamplingParams(max_tokens=4, min_tokens=2, allowed_token_ids=[2])
    says = r"min_tokens=2: every one of allowed_token_ids \[2\] ends the sequence"
    with pytest.raises(RefusedRequest, match=says):
        llm.generate([[5, 6]], params, use_tqdm=False)
    with pytest.raises(RefusedRequest, match=says):
        llm.engine.add((5, 6), params)


def test_no_max_tokens_runs_to_the_end_of_the_context():
    llm = ts.LLM(text_model_dir(), page_size=4, max_model_len=32)
    prompt = list(range(3, 23))
    [out] = llm.generate([prompt], ts.SamplingParams(temperature=0, max_tokens=None, ignore_eos=True),
                         use_tqdm=False)
    assert (len(out.token_ids), out.finish_reason) == (12, "length")
    small_pool = ts.LLM(text_model_dir(), page_size=4, max_model_len=32, num_kv_pages=6)   # 5 usable: 20 tokens
    [out] = small_pool.generate([prompt[:8]], ts.SamplingParams(temperature=0, max_tokens=None, ignore_eos=True),
                                use_tqdm=False)
    assert (len(out.token_ids), out.finish_reason) == (12, "length")
    assert str(refusal([5] * 64, max_tokens=None)) == ("prompt 3: 64 prompt tokens leave no room for an output "
                                                       "token (max_model_len=64, 10 KV pages: 40 tokens at most)")


@given(prompt_tokens=st.integers(1, 45), max_tokens=st.integers(1, 100))
def test_a_default_max_tokens_is_fitted_to_the_room_left(prompt_tokens, max_tokens):
    """Cut to what the context and the pool leave (10 pages: 40 tokens), never raised; a
    prompt with no room is refused for the room it leaves, not for a max_tokens never asked."""
    from tokenspeed.scheduling.prompt_limits import fitted
    params = ts.SamplingParams(max_tokens=max_tokens)
    got = fitted(LIMITS, prompt_tokens, params)
    if prompt_tokens >= 40:
        assert got == attrs.evolve(params, max_tokens=None)
        with pytest.raises(RefusedRequest, match=f"{prompt_tokens} prompt tokens leave no room for an output token"):
            check_request(LIMITS, 0, (5,) * prompt_tokens, got, has_tokenizer=True)
    else:
        assert got.max_tokens == min(max_tokens, 40 - prompt_tokens)
        check_request(LIMITS, 0, (5,) * prompt_tokens, got, has_tokenizer=True)
    assert fitted(LIMITS, prompt_tokens, ts.SamplingParams(max_tokens=None)).max_tokens is None


def test_the_defaults_end_with_the_context_and_asked_for_max_tokens_is_refused():
    """A call without params takes the defaults (``max_tokens`` 16 here) cut to the room
    left, as vLLM ends such a request; the same 16 asked for is refused."""
    llm = ts.LLM(text_model_dir(), page_size=4, max_model_len=32)
    prompt = list(range(3, 25))   # 22 tokens: room for 10
    [out] = llm.generate([prompt], use_tqdm=False)
    made, finish = len(out.outputs[0].token_ids), out.outputs[0].finish_reason
    assert made <= 10 and (made == 10 if finish == "length" else finish == "stop")
    assert list(llm.stream(prompt))   # refused at the call before
    with pytest.raises(RefusedRequest, match="22 prompt tokens \\+ max_tokens=16 = 38 exceeds max_model_len=32"):
        llm.generate([prompt], ts.SamplingParams(max_tokens=16), use_tqdm=False)


def test_the_message_names_the_prompt_value_and_limit():
    refused = refusal([5] * 10, max_tokens=60)
    assert str(refused) == "prompt 3: 10 prompt tokens + max_tokens=60 = 70 exceeds max_model_len=64"


@given(st.lists(st.integers(-2**70, 2**70), min_size=1, max_size=20))
def test_any_token_outside_the_vocabulary_is_the_value_refused(prompt):
    bad = [t for t in prompt if not 0 <= t < LIMITS.vocab_size]
    if not bad:
        check_request(LIMITS, 3, tuple(prompt), ts.SamplingParams(max_tokens=1), has_tokenizer=True)
        return
    refused = refusal(prompt, max_tokens=1)
    assert (refused.field, refused.value, refused.limit) == ("prompt", bad[0], LIMITS.vocab_size)


@pytest.mark.parametrize("params, field, value", [
    ({"temperature": -1.0}, "temperature", -1.0), ({"top_k": 2**63}, "top_k", 2**63),
    ({"stop": ["ok", ""]}, "stop", ""), ({"max_tokens": 4, "min_tokens": 5}, "min_tokens", 5),
    ({"stop": 5}, "stop", 5), ({"stop_token_ids": 7}, "stop_token_ids", 7),
    ({"allowed_token_ids": 7}, "allowed_token_ids", 7)])
def test_a_sampling_value_refused_carries_its_field(params, field, value):
    """A bad ``SamplingParams`` value is a ``RefusedRequest`` naming its field: the server's
    error ``param`` is read from it, never from the message."""
    with pytest.raises(RefusedRequest) as refused:
        ts.SamplingParams(**params)
    assert (refused.value.field, refused.value.value) == (field, value)
    assert str(refused.value).startswith(f"{field}=")


def test_a_refusal_survives_pickling_with_its_fields():
    refused = refusal([5, 100])
    again = pickle.loads(pickle.dumps(refused))
    assert (str(again), again.field, again.value, again.limit) == \
        (str(refused), refused.field, refused.value, refused.limit)


def test_a_broken_invariant_is_an_internal_error_not_bad_input():
    allocator = BlockAllocator(4)
    with pytest.raises(InternalError, match="page 2 is not allocated") as fault:
        allocator.free([2])
    assert not isinstance(fault.value, ValueError)


def test_a_request_of_no_max_tokens_is_made_with_its_limit():
    """``max_tokens=None`` is the engine's to resolve (``output_limit``) before a Request exists."""
    from tokenspeed.scheduling.request import Request
    with pytest.raises(InternalError, match="needs its max_output"):
        Request(0, (1, 2), ts.SamplingParams(max_tokens=None), 0)
    assert Request(0, (1, 2), ts.SamplingParams(max_tokens=None), 0, max_output=5).max_output == 5


def test_the_cli_prints_bad_input_as_one_line(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "hi", "--model", str(text_model_dir()), "--max-tokens", "100000"])
    assert str(exit_.value).startswith("tokenspeed generate: error: prompt 0: ")
    assert "\n" not in str(exit_.value) and "Traceback" not in capsys.readouterr().err


FREE_TWICE = """
from tokenspeed.scheduling.block_allocator import BlockAllocator
free = BlockAllocator.free
def free_twice(self, pages):
    pages = list(pages)
    free(self, pages)
    free(self, pages)
BlockAllocator.free = free_twice
from tokenspeed.cli.main import main
main(["generate", "hi", "--model", {model!r}, "--max-tokens", "2"])
"""


def test_the_cli_prints_an_internal_fault_with_its_traceback():
    """A real fault at a real invariant: pages freed twice (a scheduler bug, simulated)."""
    done = subprocess.run([sys.executable, "-c", FREE_TWICE.format(model=str(text_model_dir()))],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 1
    assert "Traceback (most recent call last)" in done.stderr
    assert "tokenspeed.errors.InternalError: page" in done.stderr and "is not allocated" in done.stderr
