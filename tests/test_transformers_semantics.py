"""Configs that transformers reads in a way a plain reading of the fields would not: the
tokens are transformers' own, from the checkpoint as ``from_pretrained`` loads it.

- ``tie_word_embeddings: true`` with a distinct ``lm_head.weight`` in the file: both are
  kept (``PreTrainedModel.tie_weights`` unties a pair present with different values);
  with only ``lm_head.weight`` the embedding is tied to it.
- A ``mistral`` config with ``layer_types`` is Ministral to transformers' ``AutoConfig``:
  only the layers marked ``sliding_attention`` are windowed.
"""

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import tokenspeed as ts

from hf_models import _COMMON, edit_config, new_tmpdir, randomize

PROMPTS = [list(range(3, 40)), [5, 9, 200, 17, 33, 61, 90, 120, 7, 250, 31, 64, 12, 8, 300, 41, 77, 150]]
MAX_TOKENS = 12


def transformers_tokens(path, prompts=PROMPTS) -> list[list[int]]:
    """Greedy tokens of the checkpoint at ``path`` as transformers loads it, each step's
    top-2 gap checked so that rounding cannot flip a token."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    for prompt in prompts:
        with torch.no_grad():
            ref = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False,
                                 eos_token_id=None, pad_token_id=0, output_logits=True,
                                 return_dict_in_generate=True)
        assert min(float(step[0].topk(2).values.diff().abs()) for step in ref.logits) > 1e-3
        out.append(ref.sequences[0, len(prompt):].tolist())
    return out


def our_tokens(path, prompts=PROMPTS) -> list[list[int]]:
    llm = ts.LLM(path, enforce_eager=True, max_model_len=128, page_size=4)
    params = ts.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [list(o.token_ids) for o in llm.generate(prompts, params)]


def saved(model_cls, config, seed: int, edit=None):
    """A random-weight checkpoint; ``edit(tensors)`` rewrites its safetensors file."""
    path = new_tmpdir("ts_semantics_")
    randomize(model_cls(config).eval(), seed).save_pretrained(path)
    if edit is not None:
        file = path / "model.safetensors"
        tensors = load_file(str(file))
        edit(tensors)
        save_file(tensors, str(file), metadata={"format": "pt"})
    return path


def tied_llama(edit):
    config = transformers.LlamaConfig(**{**_COMMON, "tie_word_embeddings": True})
    return saved(transformers.LlamaForCausalLM, config, seed=7, edit=edit)


def distinct_lm_head(tensors):
    embedding = tensors["model.embed_tokens.weight"]
    tensors["lm_head.weight"] = torch.randn(embedding.shape, generator=torch.Generator().manual_seed(5)) / 8


def lm_head_only(tensors):
    tensors["lm_head.weight"] = tensors.pop("model.embed_tokens.weight")


def test_tied_config_with_a_distinct_lm_head_keeps_both():
    path = tied_llama(distinct_lm_head)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path)
    assert not torch.equal(hf.lm_head.weight, hf.model.embed_tokens.weight)   # transformers unties
    model = ts.models.load(path)
    assert not model.config.tie_word_embeddings
    assert torch.equal(model.lm_head.weight, hf.lm_head.weight)
    assert our_tokens(path) == transformers_tokens(path)


def test_tied_config_with_the_lm_head_alone_ties_the_embedding_to_it():
    path = tied_llama(lm_head_only)
    model = ts.models.load(path)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert our_tokens(path) == transformers_tokens(path)


def test_tied_config_with_an_equal_lm_head_stays_tied():
    path = tied_llama(lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"].clone()}))
    model = ts.models.load(path)
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


@pytest.mark.parametrize("layer_types, windows", [
    (["full_attention", "sliding_attention"], (0, 6)),
    (["sliding_attention", "full_attention"], (6, 0)),
    (["sliding_attention", "sliding_attention"], (6, 6)),
])
def test_mistral_layer_types_window_the_layers_they_name(layer_types, windows):
    """transformers' AutoConfig reads a ``mistral`` config with ``layer_types`` as
    Ministral, whose attention follows ``layer_types`` (``MistralForCausalLM`` built
    directly would window every layer; from_pretrained on a directory goes through Auto)."""
    config = transformers.MistralConfig(**_COMMON, sliding_window=6,
                                        rope_parameters={"rope_type": "default", "rope_theta": 1000.0})
    path = saved(transformers.MistralForCausalLM, config, seed=9)
    edit_config(path, layer_types=layer_types)
    assert type(transformers.AutoConfig.from_pretrained(path)).__name__ == "MinistralConfig"
    assert ts.models.load(path).config.layer_windows == windows
    assert our_tokens(path) == transformers_tokens(path)
