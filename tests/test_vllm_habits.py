"""What a vLLM user types works, and Python misuse is one clear error naming the argument
and what is accepted: ``get_tokenizer()``, logprobs as token id -> ``Logprob(logprob,
rank, decoded_token)``, a chat message dict where a list belongs, several prompts given
to ``stream``, a misspelt keyword argument."""

import io
import re

import pytest

import tokenspeed as ts
from tokenspeed.execution.outputs import Logprob

from text_models import text_model_dir

GREEDY = ts.SamplingParams(temperature=0, max_tokens=6)


@pytest.fixture(scope="module")
def llm():
    return ts.LLM(text_model_dir(), page_size=4, max_num_seqs=4)


def test_get_tokenizer_is_the_engines(llm):
    assert llm.get_tokenizer() is llm.tokenizer
    assert llm.get_tokenizer().decode(llm.get_tokenizer().encode("The sea is")) == "The sea is"


def test_logprobs_read_as_vllms_with_each_tokens_text(llm):
    params = ts.SamplingParams(temperature=0, max_tokens=6, logprobs=3)
    [out] = llm.generate("The sea is", params, use_tqdm=False)
    decode = llm.get_tokenizer().decode
    for token_id, position in zip(out.token_ids, out.logprobs):
        assert position.token_id == token_id and list(position)[0] == token_id   # the server's fields
        assert position[token_id] == Logprob(position.logprob, 1, decode([token_id], skip_special_tokens=False))
        assert [position[t].rank for t in position.top] == [1, 2, 3] and len(position) == 3
        assert {t: lp.logprob for t, lp in position.items()} == position.top
        assert all(lp.decoded_token == decode([t], skip_special_tokens=False) for t, lp in position.items())
        with pytest.raises(KeyError):
            position[max(position.top) + 1]


def test_a_sampled_token_outside_the_top_has_its_vocabulary_rank(llm):
    """As vLLM's: the rank it would have among the top ones, had enough been asked for."""
    params = ts.SamplingParams(temperature=1.0, max_tokens=8, logprobs=0, seed=3)
    [out] = llm.generate("The sea is", params, use_tqdm=False)
    [wide] = llm.generate("The sea is", params.clone(logprobs=20), use_tqdm=False)
    assert wide.token_ids == out.token_ids and any(p[t].rank > 1 for t, p in zip(out.token_ids, out.logprobs))
    for token_id, position, ranked in zip(out.token_ids, out.logprobs, wide.logprobs):
        assert list(position) == [token_id] and position[token_id].logprob == position.logprob
        rank = position[token_id].rank
        assert rank == ranked[token_id].rank if rank <= 20 else token_id not in list(ranked.top)[:20]


@pytest.mark.parametrize("call, error, message", [
    (lambda llm: llm.chat({"role": "user", "content": "Hi"}), TypeError,
     "messages must be a list of message dicts (one conversation) or a list of such lists, got dict"),
    (lambda llm: llm.chat([{"role": "robot", "content": "Hi"}]), ValueError,
     "messages[0].role='robot': must be one of system, user, assistant, developer, tool"),
    (lambda llm: llm.chat([[{"role": "user", "content": "Hi"}], [{"role": "user", "content": 5}]]), TypeError,
     "messages[1][0].content must be a string or a list of text parts, got int 5"),
    (lambda llm: llm.chat([{"role": "user", "content": "Hi", "tool_calls": []}]), ValueError,
     "messages[0].tool_calls: only a message of role 'assistant' has one, not one of role 'user'"),
    (lambda llm: llm.chat([{"role": "user", "content": "Hi", "colour": "red"}]), ValueError,
     "messages[0] has unknown field(s) ['colour']"),
    (lambda llm: llm.stream(["a", "b"]), ValueError,
     "stream takes one prompt (a string, token ids or a prompt dict), got a list of 2"),
    (lambda llm: llm.stream("a", ts.SamplingParams(n=2)), ValueError, "stream takes one completion: n=2"),
    (lambda llm: llm.generate("a", {"temperature": 0}), TypeError,
     "sampling_params must be a SamplingParams or a list of them, got dict"),
])
def test_misuse_is_one_clear_error(llm, call, error, message):
    with pytest.raises(error, match="^" + re.escape(message)):
        call(llm)
    assert not llm.engine.has_work


def test_a_misspelt_keyword_is_named_with_what_is_accepted():
    with pytest.raises(TypeError, match=r"^LLM\(\) got an unknown argument 'gpu_mem' \(did you mean "
                                        r"'gpu_memory_utilization'\?\); it takes model, device, .*page_size"):
        ts.LLM(text_model_dir(), gpu_mem=0.5)


def test_chat_takes_what_the_server_takes(llm):
    plain = [{"role": "system", "content": "Be brief.\nBe kind."}, {"role": "user", "content": "Hi!"}]
    parts = [{"role": "developer", "content": [{"type": "text", "text": "Be brief."},   # joined by a newline
                                               {"type": "text", "text": "Be kind."}]},
             {"role": "user", "content": "Hi!", "name": "ada"}]
    want = llm.chat(plain, GREEDY, use_tqdm=False)[0]
    got = llm.chat(parts, GREEDY, use_tqdm=False)[0]
    assert got.prompt == want.prompt and got.token_ids == want.token_ids


def test_chat_continues_a_begun_reply_and_takes_a_template(llm):
    """vLLM's ``continue_final_message`` and ``chat_template`` keywords."""
    begun = [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello, I am"}]
    out = llm.chat(begun, GREEDY, continue_final_message=True, add_generation_prompt=False, use_tqdm=False)[0]
    whole = llm.get_tokenizer().apply_chat_template(begun, add_generation_prompt=False, tokenize=False)
    assert out.prompt == whole[:whole.rindex("Hello, I am") + len("Hello, I am")] and out.prompt.endswith("I am")
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    assert llm.chat(begun[:1], GREEDY, chat_template=template, use_tqdm=False)[0].prompt == "[user] Hi!\n"
    with pytest.raises(ValueError, match="pass add_generation_prompt=False"):
        llm.chat(begun, GREEDY, continue_final_message=True, use_tqdm=False)
    with pytest.raises(ValueError, match=r"chat_template: not a Jinja template \(line 1"):
        llm.chat(begun, GREEDY, chat_template="{% for m %}", use_tqdm=False)


def test_completion_outputs_carry_vllms_cumulative_logprob_and_finished(llm):
    """Scripts rank samples by ``cumulative_logprob``: the sum of the kept tokens' logprobs,
    None where logprobs were not asked for (as vLLM's)."""
    params = ts.SamplingParams(temperature=1.0, max_tokens=5, logprobs=1, n=2, seed=4)
    [out] = llm.generate("The sea is", params, use_tqdm=False)
    for sample in out.outputs:
        assert sample.cumulative_logprob == sum(p[t].logprob for t, p in zip(sample.token_ids, sample.logprobs))
        assert sample.cumulative_logprob < 0 and sample.finished()
    [plain] = llm.generate("The sea is", GREEDY, use_tqdm=False)
    assert plain.outputs[0].cumulative_logprob is None
    assert plain.num_cached_tokens == plain.metrics.num_cached_tokens


def test_vllms_sampling_fields_at_their_defaults_are_taken_and_otherwise_named():
    """A ported script spells out vLLM's defaults (``detokenize=True``, ``best_of=None``):
    they change nothing here, so they are taken; any other value is refused naming the
    field, and a misspelt one names the closest field, not Python's "unexpected keyword"."""
    spelled = ts.SamplingParams(temperature=0, max_tokens=6, best_of=None, prompt_logprobs=None, detokenize=True,
                                spaces_between_special_tokens=True, logits_processors=[], bad_words=None)
    assert spelled == GREEDY and spelled.clone(max_tokens=6) == GREEDY
    for field, value in [("prompt_logprobs", 1), ("best_of", 2), ("detokenize", False), ("bad_words", ["x"]),
                         ("detokenize", 1), ("truncate_prompt_tokens", 8)]:
        refusal = f"{field}={value!r}: vLLM's {field} is not supported here ("
        with pytest.raises(ValueError, match="^" + re.escape(refusal)):
            ts.SamplingParams(**{field: value})
    with pytest.raises(TypeError, match=r"^SamplingParams\(\) got an unknown argument 'max_tokns' \(did you "
                                        r"mean 'max_tokens'\?\); it takes n, temperature, "):
        ts.SamplingParams(max_tokns=3)


def test_a_tokens_prompt_may_carry_its_text_and_vllms_other_keys_are_named(llm):
    """vLLM's ``TokensPrompt`` may hold the ``prompt`` text its ids encode: the ids are
    generated from, the text is the output's ``prompt``."""
    ids = llm.get_tokenizer().encode("The sea is")
    [out] = llm.generate({"prompt_token_ids": ids, "prompt": "The sea is"}, GREEDY, use_tqdm=False)
    [plain] = llm.generate(ids, GREEDY, use_tqdm=False)
    assert out.prompt == "The sea is" and out.prompt_token_ids == tuple(ids) and out.token_ids == plain.token_ids
    assert llm.generate({"prompt": "The sea is", "multi_modal_data": None}, GREEDY,
                        use_tqdm=False)[0].token_ids == plain.token_ids
    with pytest.raises(ValueError, match=r"^prompt 1: vLLM's prompt key 'cache_salt' is not supported here \("):
        llm.generate(["a", {"prompt": "b", "cache_salt": "user-1"}], GREEDY, use_tqdm=False)
    with pytest.raises(TypeError, match=r"^prompt 0: 'prompt' must be a string, got 5"):
        llm.generate({"prompt_token_ids": ids, "prompt": 5}, GREEDY, use_tqdm=False)
    assert not llm.engine.has_work


def test_use_tqdm_may_be_the_bars_factory_as_in_vllm(llm):
    """vLLM's ``use_tqdm=functools.partial(tqdm, ...)``: the callable makes the bar, which
    counts the call's prompts."""
    made = []

    def factory(**keywords):
        from tqdm import tqdm
        made.append(tqdm(**keywords, file=io.StringIO()))
        return made[-1]
    llm.generate(["a", "b"], GREEDY, use_tqdm=factory)
    llm.chat([{"role": "user", "content": "Hi"}], GREEDY, use_tqdm=factory)
    assert [(bar.total, bar.n) for bar in made] == [(2, 2), (1, 1)]


def test_vllms_engine_and_call_arguments_at_neutral_values_are_taken_and_otherwise_named(llm):
    """``tensor_parallel_size=1``, ``trust_remote_code=True``, ``lora_request=None``: a ported
    script's arguments that change nothing here run; another value is refused naming the
    argument and why, before any model loads or any request queues."""
    small = dict(page_size=4, max_num_seqs=2, num_kv_pages=64)
    ts.LLM(text_model_dir(), tensor_parallel_size=1, trust_remote_code=True, **small)
    with pytest.raises(ValueError, match=r"^LLM\(\) tensor_parallel_size=2: vLLM's tensor_parallel_size is not "
                                         r"supported here \(a model runs on one device here\); only 1 is accepted"):
        ts.LLM("/nonexistent", tensor_parallel_size=2)
    with pytest.raises(ValueError, match=r"^LLM\(\) block_size=16: .*its name here is page_size"):
        ts.LLM("/nonexistent", block_size=16)
    conversation = [{"role": "user", "content": "Hi"}]
    assert llm.generate("a", GREEDY, use_tqdm=False, lora_request=None, priority=None)[0].token_ids == \
        llm.generate("a", GREEDY, use_tqdm=False)[0].token_ids
    llm.chat(conversation, GREEDY, use_tqdm=False, chat_template_content_format="string", lora_request=None)
    with pytest.raises(ValueError, match=r"^generate\(\) priority=\[1\]: vLLM's priority is not supported here"):
        llm.generate("a", GREEDY, use_tqdm=False, priority=[1])
    with pytest.raises(ValueError, match=r"^chat\(\) chat_template_content_format='openai': "):
        llm.chat(conversation, GREEDY, use_tqdm=False, chat_template_content_format="openai")
    with pytest.raises(TypeError, match=r"^generate\(\) got an unknown argument 'use_tdqm' \(did you mean "
                                        r"'use_tqdm'\?\)"):
        llm.generate("a", GREEDY, use_tdqm=False)
    assert not llm.engine.has_work


def test_get_tokenizer_answers_the_lookups_vllm_scripts_make_as_transformers_does(llm):
    """vLLM's examples build ``stop_token_ids=[tokenizer.eos_token_id,
    tokenizer.convert_tokens_to_ids("<|im_end|>")]`` from ``llm.get_tokenizer()``."""
    transformers = pytest.importorskip("transformers")
    theirs = transformers.AutoTokenizer.from_pretrained(str(text_model_dir()))
    ours = llm.get_tokenizer()
    tokens = ["<|im_start|>", "<|im_end|>", "Paris", "not-a-token-at-all"]
    assert ours.eos_token_id == theirs.eos_token_id and len(ours) == len(theirs)
    assert ours.convert_tokens_to_ids(tokens) == theirs.convert_tokens_to_ids(tokens)
    assert ours.convert_tokens_to_ids("<|im_end|>") == theirs.convert_tokens_to_ids("<|im_end|>")
    assert ours.convert_ids_to_tokens([7042, 30]) == theirs.convert_ids_to_tokens([7042, 30])
    stop = ts.SamplingParams(temperature=0, max_tokens=6, stop_token_ids=[ours.eos_token_id])
    assert llm.generate("a", stop, use_tqdm=False)[0].token_ids
