"""A model's sampling defaults come from its generation_config.json (vLLM's fields), the
same in Python (``get_default_sampling_params``, used when no params are given) and on
the command line (flags left out); a GGUF file keeps ``SamplingParams``' own."""

import json

import pytest

import tokenspeed as ts
from tokenspeed.cli.main import main
from tokenspeed.models.generation_config import sampling_defaults

from text_models import text_model_dir


def model_with(tmp_path, generation: dict | str):
    """The tiny text model's files beside a generation_config.json of our own."""
    for source in text_model_dir().iterdir():
        (tmp_path / source.name).symlink_to(source)
    text = generation if isinstance(generation, str) else json.dumps(generation)
    (tmp_path / "generation_config.json").write_text(text)
    return tmp_path


def test_the_reader_takes_vllms_fields(tmp_path):
    model_with(tmp_path, {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
                          "repetition_penalty": 1.1, "max_new_tokens": 300, "do_sample": False,
                          "bos_token_id": 1, "eos_token_id": 2, "typical_p": None, "num_beams": 4})
    assert sampling_defaults(tmp_path) == {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
                                           "repetition_penalty": 1.1, "max_tokens": 300}


def test_no_file_no_defaults(tmp_path):
    assert sampling_defaults(text_model_dir()) == {}
    assert sampling_defaults(tmp_path / "model.gguf") == {}
    assert sampling_defaults(object()) == {}


@pytest.mark.parametrize("text, message", [
    ("{not json", "generation_config.json: not a JSON file"),
    ("[1, 2]", "generation_config.json: expected a JSON object, got list"),
    ('{"temperature": "hot"}', "generation_config.json: temperature='hot' is not a number"),
    ('{"max_new_tokens": true}', "generation_config.json: max_new_tokens=True is not a number"),
])
def test_a_bad_file_is_named(tmp_path, text, message):
    with pytest.raises(ValueError, match=message):
        sampling_defaults(model_with(tmp_path, text))


def test_a_bad_value_is_refused_at_load_naming_the_file(tmp_path):
    with pytest.raises(ValueError, match=r"generation_config.json: temperature=-1: must be a finite number >= 0"):
        ts.LLM(model_with(tmp_path, {"temperature": -1}))


def test_python_and_the_cli_sample_with_the_models_defaults(tmp_path, capsys):
    model = model_with(tmp_path, {"temperature": 0.0, "max_new_tokens": 5, "repetition_penalty": 1.2})
    llm = ts.LLM(model)
    defaults = llm.get_default_sampling_params()
    assert defaults == ts.SamplingParams(temperature=0.0, max_tokens=5, repetition_penalty=1.2)
    want = llm.generate("The sea is", defaults, use_tqdm=False)[0]
    [got] = llm.generate("The sea is", use_tqdm=False)
    assert got.token_ids == want.token_ids and len(got.token_ids) == 5
    assert "".join(llm.stream("The sea is")) == want.text
    main(["generate", "--model", str(model), "The sea is"])
    assert capsys.readouterr().out == want.text + "\n"
    main(["generate", "--model", str(model), "--max-tokens", "2", "The sea is"])   # a flag wins
    assert capsys.readouterr().out == llm.tokenizer.decode(want.token_ids[:2]) + "\n"


def test_without_a_file_the_defaults_are_sampling_params_own():
    assert ts.LLM(text_model_dir()).get_default_sampling_params() == ts.SamplingParams()
