"""A bad model file fails at load with one error that names the file, the field and what
is accepted, never a library's traceback: each case breaks one file of a tiny valid
checkpoint (``hf_models``) or GGUF (``test_gguf``) in a fresh copy."""

import json
import logging
import re

import gguf
import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer as Backend
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace

import tokenspeed as ts
from tokenspeed.api import model_source
from tokenspeed.cli import main as cli
from tokenspeed.models.errors import ModelFileError
from tokenspeed.tokenizer import Tokenizer
from tokenspeed.tokenizer.chat_template import ChatTemplateRefusal
from tokenspeed.tokenizer.file_errors import TokenizerFileError

from hf_models import VOCAB, checkpoint, copy_checkpoint, edit_config, new_tmpdir
from test_gguf import gguf_from_hf, header_only


def tokenizer_dir(path):
    """A word-level tokenizer.json with its config: enough for the files to be read."""
    Backend(WordLevel({"a": 0, "<unk>": 1}, unk_token="<unk>")).save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"unk_token": "<unk>"}))
    (path / "special_tokens_map.json").write_text("{}")
    assert Tokenizer.from_pretrained(path).encode("a") == [0]
    return path


def word_tokenizer(path, chat_template=None):
    """A word-level tokenizer.json of ``hf_models``' vocabulary (w0 ... w383), with its config."""
    words = {"<unk>": 0, **{f"w{i}": i for i in range(1, VOCAB)}}
    backend = Backend(WordLevel(words, unk_token="<unk>"))
    backend.pre_tokenizer = Whitespace()
    backend.save(str(path / "tokenizer.json"))
    config = {"unk_token": "<unk>", **({"chat_template": chat_template} if chat_template else {})}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def contains(*fragments):
    return "(?s)" + "".join(f"(?=.*{re.escape(str(f))})" for f in fragments)


def write_text(name: str, text: str):
    def breaks(path):
        (path / name).write_text(text)
    return breaks


def truncate(name: str, keep: float):
    def breaks(path):
        file = next(path.glob(name))
        data = file.read_bytes()
        file.write_bytes(data[:int(len(data) * keep)])
    return breaks


def config_field(**changes):
    return lambda path: edit_config(path, **changes)


# (how the checkpoint directory is broken, the file the error names, fragments it states)
BROKEN_DIRECTORIES = {
    "config-not-json": (write_text("config.json", "{'vocab_size': 384,"), "config.json", ["not valid JSON"]),
    "config-a-list": (write_text("config.json", "[1, 2]"), "config.json", ["JSON object", "list"]),
    "config-empty": (write_text("config.json", ""), "config.json", ["not valid JSON"]),
    "safetensors-truncated": (truncate("*.safetensors", 0.5), "model.safetensors",
                              ["not a readable safetensors file", "truncated"]),
    "safetensors-header-only": (truncate("*.safetensors", 0.001), "model.safetensors",
                                ["not a readable safetensors file"]),
    "safetensors-garbage": (write_text("model.safetensors", "hello, world " * 40), "model.safetensors",
                            ["not a readable safetensors file"]),
    "index-not-json": (write_text("model.safetensors.index.json", "{"), "model.safetensors.index.json",
                       ["not valid JSON"]),
    "index-missing-shard": (write_text("model.safetensors.index.json",
                                       json.dumps({"weight_map": {"lm_head.weight": "gone.safetensors"}})),
                            "model.safetensors.index.json", ["gone.safetensors"]),
    "generation-config-not-json": (write_text("generation_config.json", "nope"), "generation_config.json",
                                   ["not valid JSON"]),
    "torch_dtype-foo": (config_field(torch_dtype="foo"), "config.json",
                        ["torch_dtype='foo'", "float32, float16, bfloat16"]),
    "torch_dtype-float8": (config_field(torch_dtype="float8_e4m3fn"), "config.json",
                           ["torch_dtype='float8_e4m3fn'", "FP8", "float32, float16, bfloat16"]),
    "dtype-int8": (config_field(dtype="int8"), "config.json", ["dtype='int8'", "bfloat16"]),
    "rms_norm_eps-string": (config_field(rms_norm_eps="1e-6"), "config.json",
                            ["rms_norm_eps='1e-6'", "a finite number >= 0"]),
    "rms_norm_eps-negative": (config_field(rms_norm_eps=-1.0), "config.json", ["rms_norm_eps=-1.0", ">= 0"]),
    "vocab_size-string": (config_field(vocab_size="384"), "config.json", ["vocab_size='384'", "an integer >= 1"]),
    "vocab_size-float": (config_field(vocab_size=384.0), "config.json", ["vocab_size=384.0", "an integer"]),
    "heads-not-dividing-hidden": (config_field(num_attention_heads=5, num_key_value_heads=5, head_dim=None),
                                  "config.json", ["num_attention_heads=5", "hidden_size=64", "divisor"]),
    "heads-not-matching-weights": (config_field(num_attention_heads=8, num_key_value_heads=8), "",
                                   ["k_proj.weight", "(32, 64)", "(128, 64)",
                                    "rows: num_key_value_heads=8 x head_dim=16; columns: hidden_size=64"]),
    "ffn-not-matching-weights": (config_field(intermediate_size=100), "",
                                 ["down_proj.weight", "(64, 128)", "columns: intermediate_size=100"]),
    "zero-heads": (config_field(num_attention_heads=0), "config.json",
                   ["num_attention_heads=0", "an integer >= 1"]),
    "zero-kv-heads": (config_field(num_key_value_heads=0), "config.json",
                      ["num_key_value_heads=0", "an integer >= 1"]),
    "negative-layers": (config_field(num_hidden_layers=-2), "config.json",
                        ["num_hidden_layers=-2", "an integer >= 1"]),
    "tie-a-string": (config_field(tie_word_embeddings="false"), "config.json",
                     ["tie_word_embeddings='false'", "true or false"]),
    "rope_theta-zero": (config_field(rope_parameters={"rope_type": "default", "rope_theta": 0}), "config.json",
                        ["rope_theta=0", "> 0"]),
    "rope_parameters-a-string": (config_field(rope_parameters="default"), "config.json",
                                 ["rope_parameters='default'", "object"]),
    "eos-a-string": (config_field(eos_token_id="</s>"), "config.json", ["eos_token_id='</s>'", "token id"]),
    "eos-past-vocab": (config_field(eos_token_id=[2, 384]), "config.json",
                       ["eos_token_id=384", "vocab_size=384"]),
    "generation-eos-past-vocab": (write_text("generation_config.json", json.dumps({"eos_token_id": [2, 900]})),
                                  "generation_config.json", ["eos_token_id=900", "vocab_size=384"]),
    "max-positions-zero": (config_field(max_position_embeddings=-1), "config.json",
                           ["max_position_embeddings=-1", "an integer >= 1"]),
}


@pytest.mark.parametrize("case", BROKEN_DIRECTORIES)
def test_a_broken_checkpoint_file_is_named(case):
    breaks, file, fragments = BROKEN_DIRECTORIES[case]
    path = copy_checkpoint("llama")
    breaks(path)
    with pytest.raises(ModelFileError, match=contains(path / file, *fragments)) as error:
        ts.models.load(path)
    assert "\n" not in str(error.value)


def test_a_sharded_checkpoint_names_the_truncated_shard(tmp_path):
    from hf_models import hf_model
    model, _ = hf_model("llama")
    model.save_pretrained(tmp_path, max_shard_size="60KB")
    shard = sorted(tmp_path.glob("*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(ModelFileError, match=contains(shard, "truncated")):
        ts.models.load(tmp_path)


@pytest.mark.parametrize("keep", [0.0, 0.003, 0.05, 0.5, 0.999])
def test_a_truncated_gguf_is_named(keep):
    whole = gguf_from_hf("llama")
    path = new_tmpdir("ts_gguf_cut_") / "cut.gguf"
    data = open(whole, "rb").read()
    path.write_bytes(data[:int(len(data) * keep)])
    with pytest.raises(ModelFileError, match=contains(path, "not a readable GGUF file")):
        ts.models.load(path)
    with pytest.raises(ModelFileError, match=contains(path, "not a readable GGUF file")):
        ts.LLM(path)
    with pytest.raises(TokenizerFileError, match=contains(path, "not a readable GGUF file")):
        Tokenizer.from_pretrained(path)


def test_a_file_that_is_not_gguf_is_named():
    path = new_tmpdir("ts_gguf_foreign_") / "model.gguf"
    path.write_bytes(b"PK\x03\x04 a zip file, not a GGUF" * 100)
    with pytest.raises(ModelFileError, match=contains(path, "not a readable GGUF file")):
        ts.models.load(path)


@pytest.mark.parametrize("name, text, fragments", [
    ("tokenizer.json", "{\"version\": \"1.0\", \"model\": 5}", ["not a tokenizer.json"]),
    ("tokenizer.json", "not json", ["not a tokenizer.json"]),
    ("tokenizer.json", "", ["not a tokenizer.json"]),
    ("tokenizer_config.json", "{\"bos_token\": ", ["not valid JSON"]),
    ("tokenizer_config.json", "[]", ["JSON object", "list"]),
    ("special_tokens_map.json", "]", ["not valid JSON"]),
    # special tokens of another kind: a probe found KeyError 'content' and a TypeError
    ("tokenizer_config.json", json.dumps({"eos_token": {"lstrip": False}}),
     ["eos_token={'lstrip': False}", "expected the token's text, or an object with its text as \"content\""]),
    ("tokenizer_config.json", json.dumps({"eos_token": {"content": "a", "rstrip": "no"}}),
     ["eos_token.rstrip='no'", "true or false"]),
    ("special_tokens_map.json", json.dumps({"bos_token": 5}), ["bos_token=5", "the token's text"]),
    # transformers would add it as id 2, past the vocabulary (a probe found it added silently)
    ("tokenizer_config.json", json.dumps({"eos_token": "</s>"}),
     ["eos_token='</s>' is not a token of tokenizer.json (2 tokens", "id 2, which the model never learned"]),
    # a chat template of another kind: a probe found a TypeError and an AttributeError
    ("tokenizer_config.json", json.dumps({"chat_template": 5}),
     ["chat_template=5", "expected a Jinja template (a string) or a list of {\"name\": ..., \"template\": ...}"]),
    ("tokenizer_config.json", json.dumps({"chat_template": ["{{ 1 }}", "{{ 2 }}"]}),
     ["chat_template=['{{ 1 }}', '{{ 2 }}']", "a list of {\"name\""]),
])
def test_a_broken_tokenizer_file_is_named(tmp_path, name, text, fragments):
    path = tokenizer_dir(tmp_path)
    (path / name).write_text(text)
    with pytest.raises(TokenizerFileError, match=contains(path / name, *fragments)) as error:
        Tokenizer.from_pretrained(path)
    assert "\n" not in str(error.value)


def test_a_chat_template_jinja_that_is_not_utf8_is_named(tmp_path):
    path = tokenizer_dir(tmp_path)
    (path / "chat_template.jinja").write_bytes("{{ 'caf\xe9' }}".encode("latin-1"))
    with pytest.raises(TokenizerFileError, match=contains(path / "chat_template.jinja", "not UTF-8 text")):
        Tokenizer.from_pretrained(path)


def test_named_chat_templates_read_the_default_one(tmp_path):
    """transformers' list form: {name, template} objects, "default" the one used."""
    path = tokenizer_dir(tmp_path)
    named = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "{{ messages[0].content }}"}]
    (path / "tokenizer_config.json").write_text(json.dumps({"unk_token": "<unk>", "chat_template": named}))
    tokenizer = Tokenizer.from_pretrained(path)
    assert tokenizer.apply_chat_template([{"role": "user", "content": "a"}], tokenize=False) == "a"


BROKEN_TEMPLATE = "{% if %}"
CONVERSATION = [{"role": "user", "content": "a"}]


@pytest.mark.parametrize("file", ["tokenizer_config.json", "chat_template.jinja"])
def test_a_chat_template_that_does_not_parse_is_refused_at_chat_naming_its_file(tmp_path, file):
    """Plain prompts never need it (vLLM too fails only at chat time); a probe found the
    tokenizer refused at load as "chat_template: not a Jinja template", naming no file."""
    path = tokenizer_dir(tmp_path)
    if file == "chat_template.jinja":
        (path / file).write_text(BROKEN_TEMPLATE)
    else:
        (path / file).write_text(json.dumps({"unk_token": "<unk>", "chat_template": BROKEN_TEMPLATE}))
    with pytest.warns(UserWarning, match=contains(path / file, "not a Jinja template (line 1")):
        tokenizer = Tokenizer.from_pretrained(path)
    assert tokenizer.encode("a") == [0]
    with pytest.raises(ChatTemplateRefusal, match=contains("the model's chat template cannot be used", path / file,
                                                           "not a Jinja template (line 1")):
        tokenizer.apply_chat_template(CONVERSATION)
    by_hand = tokenizer.apply_chat_template(CONVERSATION, tokenize=False, chat_template="{{ messages[0].content }}")
    assert by_hand == "a"


def test_a_model_whose_chat_template_does_not_parse_still_generates_from_text():
    path = word_tokenizer(copy_checkpoint("llama"), chat_template=BROKEN_TEMPLATE)
    with pytest.warns(UserWarning, match=contains(path / "tokenizer_config.json", "not a Jinja template")):
        llm = ts.LLM(path, device="cpu", enforce_eager=True, max_model_len=64, page_size=4, max_num_seqs=2)
    params = ts.SamplingParams(temperature=0, max_tokens=3)
    assert len(llm.generate("w5 w6", params, use_tqdm=False)[0].token_ids) == 3
    with pytest.raises(ChatTemplateRefusal, match=contains(path / "tokenizer_config.json", "not a Jinja template")):
        llm.chat([{"role": "user", "content": "w5"}], params, use_tqdm=False)


def test_an_eos_token_among_tokenizer_jsons_added_tokens_is_accepted(tmp_path):
    path = tokenizer_dir(tmp_path)
    backend = Backend.from_file(str(path / "tokenizer.json"))
    backend.add_special_tokens(["</s>"])
    backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"unk_token": "<unk>", "eos_token": "</s>"}))
    tokenizer = Tokenizer.from_pretrained(path)
    assert tokenizer.eos_token_ids == (2,) and tokenizer.vocab_size == 3


def sentencepiece_only(path):
    (path / "tokenizer.model").write_bytes(b"\x0a\x05hello")
    (path / "tokenizer_config.json").write_text("{}")


def slow_bpe_only(path):
    (path / "vocab.json").write_text("{}")
    (path / "merges.txt").write_text("")


@pytest.mark.parametrize("breaks, reason", [
    (sentencepiece_only, "{dir} has tokenizer.model, tokenizer_config.json but no tokenizer.json"),
    (slow_bpe_only, "{dir} has vocab.json, merges.txt but no tokenizer.json"),
    (lambda path: (path / "tokenizer.json").mkdir(), "{dir}/tokenizer.json is not a file"),
], ids=["tokenizer.model", "vocab.json+merges.txt", "tokenizer.json-a-directory"])
def test_a_model_directory_whose_tokenizer_is_not_tokenizer_json_is_said_at_load(tmp_path, caplog, breaks, reason):
    """Token ids still serve, so not a refusal; but a probe found no word of it until a
    text prompt was refused for "no tokenizer" with a model path given."""
    breaks(tmp_path)
    reason = reason.format(dir=tmp_path)
    with caplog.at_level(logging.WARNING, logger=model_source.__name__):
        assert model_source.tokenizer_of(None, tmp_path) is None
    assert [r.getMessage() for r in caplog.records] == [
        f"{reason}: tokenspeed reads a tokenizer from tokenizer.json only, so this model takes token-id prompts "
        f"alone; for text, pass tokenizer=<a directory or model id with a tokenizer.json>"]
    assert model_source.no_tokenizer_reason(tmp_path) == reason
    with pytest.raises(FileNotFoundError, match=contains(reason, "tokenizer.json only")):
        Tokenizer.from_pretrained(tmp_path)


def test_a_model_without_tokenizer_json_still_takes_token_ids_and_says_why_once(caplog):
    path = copy_checkpoint("llama")
    sentencepiece_only(path)
    with caplog.at_level(logging.WARNING, logger=model_source.__name__):
        llm = ts.LLM(path, device="cpu", enforce_eager=True, max_model_len=64, page_size=4, max_num_seqs=2)
    assert llm.tokenizer is None
    said = [r.getMessage() for r in caplog.records if "tokenizer.json" in r.getMessage()]
    assert len(said) == 1 and str(path) in said[0] and "tokenizer.model" in said[0]
    params = ts.SamplingParams(temperature=0, max_tokens=3)
    assert len(llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].token_ids) == 3


def test_a_directory_of_weights_alone_says_nothing_of_tokenizers(caplog):
    with caplog.at_level(logging.WARNING, logger=model_source.__name__):
        assert model_source.tokenizer_of(None, copy_checkpoint("llama")) is None
    assert not caplog.records


def test_the_cli_prints_a_bad_model_file_as_one_line(capsys):
    path = copy_checkpoint("llama")
    edit_config(path, rms_norm_eps="1e-6")
    with pytest.raises(SystemExit) as exit_:
        cli.main(["generate", "--model", str(path), "hello"])
    message = str(exit_.value.code)
    assert message.startswith("tokenspeed generate: error: ") and "\n" not in message
    assert str(path / "config.json") in message and "rms_norm_eps='1e-6'" in message


def test_a_tensor_of_a_dtype_the_engine_cannot_run_is_named():
    path = copy_checkpoint("llama")
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    tensors["model.norm.weight"] = tensors["model.norm.weight"].to(torch.float8_e4m3fn)
    save_file(tensors, str(file), metadata={"format": "pt"})
    with pytest.raises(ModelFileError, match=contains(file, "model.norm.weight", "float8_e4m3fn",
                                                      "float32, float16, bfloat16")):
        ts.models.load(path)


def test_a_dtype_argument_the_engine_cannot_run_is_refused():
    with pytest.raises(ValueError, match=contains("dtype=torch.float8_e4m3fn", "float32, float16, bfloat16")):
        ts.models.load(copy_checkpoint("llama"), dtype=torch.float8_e4m3fn)


@pytest.mark.parametrize("key, value, fragments", [
    ("attention.head_count", 0, ["llama.attention.head_count=0", "an integer >= 1"]),
    ("block_count", 0, ["num_hidden_layers=0", "an integer >= 1"]),
    ("attention.head_count_kv", 0, ["num_key_value_heads=0", "an integer >= 1"]),
])
def test_gguf_metadata_out_of_range_is_named(key, value, fragments):
    path = header_only(**{key: (value, gguf.GGUFValueType.UINT32)})
    with pytest.raises(ModelFileError, match=contains(path, *fragments)):
        ts.models.load(path)


def test_a_directory_of_pytorch_weights_names_them_and_the_way_to_safetensors(tmp_path):
    """A save with ``pytorch_model.bin`` (older transformers, ``safe_serialization=False``)
    is refused naming that file, not as a directory with no weights."""
    (tmp_path / "config.json").write_text((checkpoint("llama") / "config.json").read_text())
    torch.save(load_file(str(checkpoint("llama") / "model.safetensors")), tmp_path / "pytorch_model.bin")
    (tmp_path / "training_args.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors files in .*\(it holds PyTorch weights, "
                                                r"pytorch_model\.bin: tokenspeed reads safetensors only"):
        ts.models.load(tmp_path)


def test_a_directory_of_gguf_files_names_them_as_the_models_to_load(tmp_path):
    """A GGUF repository's folder (no config.json) is refused naming its files, each a
    model to be named by its path, which then loads."""
    (tmp_path / "tiny.Q8_0.gguf").write_bytes(open(gguf_from_hf("llama"), "rb").read())
    with pytest.raises(FileNotFoundError, match=r"config\.json not found.*\(it holds GGUF files, tiny\.Q8_0\.gguf: "
                                                r"a GGUF model is loaded by its file's path, .*tiny\.Q8_0\.gguf\)"):
        ts.models.load(tmp_path)
    assert ts.models.load(tmp_path / "tiny.Q8_0.gguf").config.architecture == "LlamaForCausalLM"
