"""``Tokenizer.token_bytes``: each token's real bytes (no U+FFFD standing in for a byte),
so that a completion's tokens' bytes, joined, decode to its text: byte-level BPE from a
GGUF and from tokenizer.json, SentencePiece byte fallback from a GGUF."""

import pytest
from hypothesis import assume, given, settings, strategies as st

from tokenspeed.tokenizer import load_tokenizer
from tokenspeed.tokenizer.token_bytes import byte_decoder

from test_tokenizer import SPM_PIECES, write_gguf
from text_models import smol_tokenizer, text_model_dir

FAST = settings(max_examples=60, deadline=None, derandomize=True)
TEXT = st.text(st.characters(codec="utf-8"), max_size=40) | st.sampled_from(
    ["café 😀 中文", "👩‍👩‍👧 family", "<|im_start|>user\nHi<|im_end|>", "ÿþ\x00\x01 control bytes"])


@pytest.fixture(scope="module", params=["gguf", "tokenizer.json"])
def byte_level(request):
    return smol_tokenizer() if request.param == "gguf" else load_tokenizer(text_model_dir())


@pytest.fixture(scope="module")
def spm(tmp_path_factory):
    """SentencePiece pieces with ``<0xNN>`` byte tokens for every character they lack."""
    normal = list(dict.fromkeys(["▁", *"abcdefghijklmnopqrstuvwxyz!,.", *SPM_PIECES]))
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *normal]
    types = [2, 3, 3, *[6] * 256, *[1] * len(normal)]
    scores = [0.0] * 259 + [-float(i) for i in range(len(normal))]
    path = write_gguf(tmp_path_factory.mktemp("spm") / "spm.gguf", "llama", tokens, types, scores,
                      bos_token_id=1, eos_token_id=2, unk_token_id=0)
    return load_tokenizer(path)


def joined(tokenizer, ids) -> bytes:
    return b"".join(tokenizer.token_bytes(i) for i in ids)


def test_the_byte_alphabet_is_one_character_per_byte():
    alphabet = byte_decoder()
    assert sorted(alphabet.values()) == list(range(256)) and alphabet["Ġ"] == 32 and alphabet["a"] == 97


@FAST
@given(text=TEXT)
def test_byte_level_tokens_join_to_the_text(byte_level, text):
    ids = byte_level.encode(text, add_special_tokens=False)
    assume(byte_level.decode(ids, skip_special_tokens=False) == text)   # bytes the vocabulary lacks are lost
    assert joined(byte_level, ids) == text.encode("utf-8")


def test_a_byte_level_fragment_is_its_bytes_not_a_replacement_character(byte_level):
    ids = byte_level.encode("😀", add_special_tokens=False)
    assert len(ids) > 1 and "\ufffd" in byte_level.decode(ids[:1])
    assert [byte_level.token_bytes(i) for i in ids] != [b"\xef\xbf\xbd"] * len(ids)
    assert joined(byte_level, ids) == "😀".encode()


@FAST
@given(text=st.text(st.sampled_from("helo wrd你好☃é!ü"), max_size=20))
def test_sentencepiece_byte_fallback_tokens_join_to_the_text(spm, text):
    """The decoder drops the space before the first word; the bytes keep it."""
    ids = spm.encode(text, add_special_tokens=False)
    whole = joined(spm, ids).decode("utf-8")
    assert whole.removeprefix(" ") == spm.decode(ids).removeprefix(" ")
    assert "\ufffd" not in whole


def test_a_byte_fallback_token_is_its_byte(spm):
    ids = spm.encode("☃", add_special_tokens=False)
    assert [spm.token_bytes(i) for i in ids][-3:] == [b"\xe2", b"\x98", b"\x83"]


def test_an_id_outside_the_vocabulary_is_named(byte_level):
    with pytest.raises(ValueError, match="token id 99999999 is outside the vocabulary"):
        byte_level.token_bytes(99999999)
