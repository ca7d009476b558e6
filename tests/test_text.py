"""Text in and text out: prompt forms, strict prompts, detokenized text, stop strings,
chat, streaming, n samples over shared pages, per-request seeds, metrics, and concurrent
callers (docs/DESIGN.md invariant 11)."""

import threading

import pytest
import torch

import tokenspeed as ts

from text_models import text_model_dir

GREEDY = ts.SamplingParams(temperature=0, max_tokens=12)
PROMPTS = ["Hello there, how are you", "The sea is", "Once upon a time in a land far away"]


@pytest.fixture(scope="module")
def llm():
    return ts.LLM(text_model_dir(), page_size=4, max_num_seqs=8)


def texts(outputs):
    return [o.text for o in outputs]


def test_every_prompt_form_gives_the_same_tokens(llm):
    ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    want = [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert [o.token_ids for o in llm.generate(ids, GREEDY, use_tqdm=False)] == want
    dicts = [{"prompt": PROMPTS[0]}, {"prompt_token_ids": ids[1]}, {"prompt": PROMPTS[2]}]
    assert [o.token_ids for o in llm.generate(dicts, GREEDY, use_tqdm=False)] == want
    [one] = llm.generate(PROMPTS[1], GREEDY, use_tqdm=False)
    [flat] = llm.generate(ids[1], GREEDY, use_tqdm=False)
    assert one.token_ids == flat.token_ids == want[1] and one.prompt == PROMPTS[1]


def test_text_is_the_decoded_tokens(llm):
    for out in llm.generate(PROMPTS, GREEDY, use_tqdm=False):
        assert out.text == llm.tokenizer.decode(out.token_ids) and out.text
        assert out.prompt_token_ids == tuple(llm.tokenizer.encode(out.prompt))


@pytest.mark.parametrize("bad, fragment", [
    ([[1.5, 2.7]], "prompt 0: token ids must be integers, got 1.5"),
    ([[3, True]], "prompt 0: token ids must be integers, got True"),
    ([[5, 6], [7, float("nan")]], "prompt 1: token ids must be integers, got nan"),
    ([[5, 6], ["12", "3"]], "prompt 1: token ids must be integers, got '12'"),
    ([b"123"], "prompt 0: expected a string"),
    ([{"text": "hi"}], "prompt 0: a prompt dict has 'prompt' (text) or 'prompt_token_ids'"),
    ([[4], {"prompt": 5}], "prompt 1: 'prompt' must be a string"),
    ([], "no prompts given"),
    (42, "prompts must be a string"),
    (["ok", "abc\ud800def"], "prompt 1: not valid Unicode (a lone surrogate '\\ud800' at character 3)"),
    ([{"prompt": "x\udc00"}], "prompt 0: not valid Unicode (a lone surrogate '\\udc00' at character 1)"),
])
def test_prompts_are_checked_not_coerced(llm, bad, fragment):
    with pytest.raises((TypeError, ValueError), match="^" + __import__("re").escape(fragment)):
        llm.generate(bad, GREEDY, use_tqdm=False)


def test_a_string_of_digits_is_text(llm):
    [out] = llm.generate("123", GREEDY, use_tqdm=False)
    assert out.prompt_token_ids == tuple(llm.tokenizer.encode("123"))


def test_stop_strings_cut_the_text_across_tokens(llm):
    [plain] = llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)
    pieces = [llm.tokenizer.decode(plain.token_ids[:i]) for i in range(len(plain.token_ids) + 1)]
    end = len(pieces[5])                  # a stop string that ends inside token 5 and starts in 4
    stop = plain.text[len(pieces[3]) + 1:end - 1]
    assert stop and stop not in plain.text[:len(pieces[3])]
    params = ts.SamplingParams(temperature=0, max_tokens=12, stop=["never appears", stop])
    [out] = llm.generate(PROMPTS[0], params, use_tqdm=False)
    assert out.text == plain.text[:plain.text.find(stop)]
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason == stop
    assert out.token_ids == plain.token_ids[:5]   # up to the token that completed the stop


def test_a_stop_string_in_the_last_allowed_token_is_the_reason(llm):
    [plain] = llm.generate(PROMPTS[0], ts.SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
    before = llm.tokenizer.decode(plain.token_ids[:4])
    stop = plain.text[len(before):].strip() or plain.text[len(before):]
    assert stop and stop not in before
    [out] = llm.generate(PROMPTS[0], ts.SamplingParams(temperature=0, max_tokens=5, stop=[stop]),
                         use_tqdm=False)
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason == stop
    assert out.text == plain.text[:plain.text.find(stop)]


def test_min_tokens_defers_stop_strings_and_stop_ids(llm):
    [plain] = llm.generate(PROMPTS[1], GREEDY, use_tqdm=False)
    first = plain.token_ids[0]
    stopped = llm.generate(PROMPTS[1], ts.SamplingParams(temperature=0, max_tokens=12,
                                                         stop_token_ids=[first]), use_tqdm=False)[0]
    assert stopped.token_ids == (first,) and stopped.outputs[0].stop_reason == first
    late = llm.generate(PROMPTS[1], ts.SamplingParams(temperature=0, max_tokens=12, min_tokens=3,
                                                      stop_token_ids=[first]), use_tqdm=False)[0]
    assert len(late.token_ids) >= 3 and first not in late.token_ids[:2]


def test_stream_pieces_join_to_the_generated_text(llm):
    params = ts.SamplingParams(temperature=0, max_tokens=12)
    pieces = list(llm.stream(PROMPTS[2], params))
    assert len(pieces) > 1 and "".join(pieces) == llm.generate(PROMPTS[2], params, use_tqdm=False)[0].text
    assert all(pieces), pieces   # a step whose token adds no text yet yields nothing
    assert not llm.engine.has_work


def test_an_answer_read_whole_is_decoded_once_at_its_end(llm, monkeypatch):
    """``generate`` reads text only once an answer is final: without stop strings no token
    is decoded on its own, with them, and in a stream, every token is."""
    from tokenspeed.tokenizer import detokenizer

    steps, stream_of = [], detokenizer.DecodeStream

    class CountedStream:
        def __init__(self, **options):
            self.stream = stream_of(**options)

        def step(self, tokenizer, ids):
            steps.append(len(ids))
            return self.stream.step(tokenizer, ids)
    monkeypatch.setattr(detokenizer, "DecodeStream", CountedStream)
    whole = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert not steps and [o.text for o in whole] == [llm.tokenizer.decode(o.token_ids) for o in whole]
    stopped = ts.SamplingParams(temperature=0, max_tokens=12, stop=["\u00ff never"])
    assert [o.text for o in llm.generate(PROMPTS, stopped, use_tqdm=False)] == [o.text for o in whole]
    assert steps
    steps.clear()
    assert "".join(llm.stream(PROMPTS[0], GREEDY)) == whole[0].text and steps


def test_chat_applies_the_template(llm):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    [out] = llm.chat(messages, GREEDY, use_tqdm=False)
    rendered = llm.tokenizer.apply_chat_template(messages, tokenize=False)
    assert out.prompt == rendered and rendered.endswith("<|im_start|>assistant\n")
    assert out.prompt_token_ids == tuple(llm.tokenizer.apply_chat_template(messages))
    assert out.token_ids == llm.generate(rendered, GREEDY, use_tqdm=False)[0].token_ids
    both = llm.chat([messages, [{"role": "user", "content": "Bye"}]], GREEDY, use_tqdm=False)
    assert len(both) == 2 and both[0].token_ids == out.token_ids


def test_a_seeded_request_samples_alike_in_any_batch(llm):
    seeded = ts.SamplingParams(temperature=1.0, max_tokens=10, seed=1234)
    other = ts.SamplingParams(temperature=0.8, max_tokens=10)
    alone = llm.generate(PROMPTS[0], seeded, use_tqdm=False)[0].token_ids
    batch = llm.generate(PROMPTS[::-1] + PROMPTS[:1], [other, other, other, seeded], use_tqdm=False)
    assert batch[3].token_ids == alone
    assert llm.generate(PROMPTS[0], ts.SamplingParams(temperature=1.0, max_tokens=10, seed=99),
                        use_tqdm=False)[0].token_ids != alone


def test_graphs_and_eager_sample_a_seeded_request_alike():
    params = ts.SamplingParams(temperature=1.0, max_tokens=8, seed=7)
    eager = ts.LLM(text_model_dir(), page_size=4, max_num_seqs=4)
    graphed = ts.LLM(text_model_dir(), page_size=4, max_num_seqs=4, graphs=True,
                     max_num_batched_tokens=64)
    assert texts(eager.generate(PROMPTS, params, use_tqdm=False)) == \
        texts(graphed.generate(PROMPTS, params, use_tqdm=False))


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_n_samples_share_the_prompt_pages_and_equal_separate_requests(prefix_caching, monkeypatch):
    llm = ts.LLM(text_model_dir(), page_size=4, max_num_seqs=8, enable_prefix_caching=prefix_caching)
    prompt = PROMPTS[2] * 2                   # several full pages of 4 tokens
    shared = []
    allocator = llm.engine.scheduler.allocator
    share = allocator.share
    monkeypatch.setattr(allocator, "share", lambda pages: shared.append(len(pages)) or share(pages))
    params = ts.SamplingParams(temperature=1.0, max_tokens=8, seed=50, n=3, logprobs=2)
    [out] = llm.generate(prompt, params, use_tqdm=False)
    shared = [n for n in shared if n]         # the first sample found nothing to share
    assert [c.index for c in out.outputs] == [0, 1, 2] and len(shared) == 2 and min(shared) > 1
    assert out.metrics.num_cached_tokens == 0             # of the first sample
    apart = ts.LLM(text_model_dir(), page_size=4, max_num_seqs=8, enable_prefix_caching=prefix_caching)
    monkeypatch.setattr(apart.engine.scheduler, "_attach_shared_pages", lambda request: None)
    [separate] = apart.generate(prompt, params, use_tqdm=False)   # each sample computes its prompt
    for completion, alone in zip(out.outputs, separate.outputs, strict=True):
        assert completion.token_ids == alone.token_ids
        assert [lp.token_id for lp in completion.logprobs] == list(completion.token_ids)
    assert out.metrics.num_output_tokens == sum(len(c.token_ids) for c in out.outputs)
    assert allocator.num_free == llm.compiled.num_pages - 1


def test_metrics_count_and_order(llm):
    [out] = llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)
    m = out.metrics
    assert m.arrival_time <= m.first_token_time <= m.finish_time
    assert m.num_prompt_tokens == len(out.prompt_token_ids) and m.num_output_tokens == len(out.token_ids)


def test_concurrent_callers_each_get_their_own_outputs(llm):
    work = [(PROMPTS[i % 3] + " " + str(i), ts.SamplingParams(temperature=0, max_tokens=4 + i))
            for i in range(6)]
    want = [llm.generate(p, sp, use_tqdm=False)[0] for p, sp in work]
    got = [None] * len(work)

    def call(i):
        got[i] = llm.generate(work[i][0], work[i][1], use_tqdm=False)[0]

    for _ in range(3):
        threads = [threading.Thread(target=call, args=(i,)) for i in range(len(work))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [(o.prompt, o.token_ids, o.text) for o in got] == \
            [(o.prompt, o.token_ids, o.text) for o in want]
    assert llm.engine.scheduler.allocator.num_free == llm.compiled.num_pages - 1


def test_the_progress_bar_reports_tokens_per_second(llm, capsys):
    llm.generate(PROMPTS, GREEDY, use_tqdm=True)
    assert "tok/s" in capsys.readouterr().err
    llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert capsys.readouterr().err == ""


def test_dtype_by_name_and_bad_names():
    assert ts.LLM(text_model_dir(), dtype="bfloat16").model.model.embed_tokens.weight.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="dtype='bf17'"):
        ts.LLM(text_model_dir(), dtype="bf17")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the error is for machines without a GPU")
def test_cuda_without_a_gpu_says_so():
    with pytest.raises(ValueError, match="no CUDA GPU is available"):
        ts.LLM(text_model_dir(), device="cuda")


def test_a_model_without_a_tokenizer_refuses_text():
    from hf_models import checkpoint
    llm = ts.LLM(checkpoint("llama"))
    assert llm.tokenizer is None
    with pytest.raises(ValueError, match="prompt 0 is text, but this engine has no tokenizer"):
        llm.generate("hi", use_tqdm=False)
    assert llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0].text is None


def test_a_stream_finished_by_another_callers_steps_still_yields_its_text(llm):
    """A generate call between two pieces runs the stream's request to its end: the rest
    of the text still comes."""
    params = ts.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = llm.generate(PROMPTS[2], params, use_tqdm=False)[0].text
    stream = llm.stream(PROMPTS[2], params)
    first = next(stream)
    llm.generate(PROMPTS[0], ts.SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False)
    assert first + "".join(stream) == want and len(want) > len(first)
