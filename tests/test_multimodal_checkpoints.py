"""Checkpoints published as a multimodal model, read as their language model: Qwen3.5 as
transformers writes ``Qwen3_5ForConditionalGeneration`` (``text_config``, tensors under
``model.language_model.``, a vision tower, M-RoPE sections, a multi-token-prediction head)
generates transformers' own tokens for text prompts."""

import functools
import json
import logging
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import tokenspeed as ts
from tokenspeed.models.errors import ModelFileError
from tokenspeed.models.loader import load

from hf_models import MAX_POS, MIN_GAP, VARIANTS, VOCAB, checkpoint, make_prompts, new_tmpdir, randomize

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(not hasattr(transformers, "Qwen3_5ForConditionalGeneration"),
                                reason="transformers without Qwen3.5")
TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, max_position_embeddings=MAX_POS,
            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16, layer_types=["linear_attention", "full_attention", "linear_attention"],
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
            linear_conv_kernel_dim=4, tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 3000.0, "partial_rotary_factor": 0.5,
                             "mrope_section": [2, 1, 1], "mrope_interleaved": True})
VISION = dict(depth=1, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64)


@functools.lru_cache(maxsize=None)
def published(tied: bool = False):
    """(transformers' model, its directory as published: with an ``mtp.*`` head beside)."""
    config = transformers.Qwen3_5Config(text_config=TEXT, vision_config=VISION, tie_word_embeddings=tied)
    torch.manual_seed(0)
    model = randomize(transformers.Qwen3_5ForConditionalGeneration(config).float().eval(), seed=9)
    if tied:
        model.tie_weights()
        assert model.lm_head.weight.data_ptr() == model.model.language_model.embed_tokens.weight.data_ptr()
    path = new_tmpdir("ts_qwen3_5_published_")
    model.save_pretrained(path)
    (file,) = path.glob("*.safetensors")
    tensors = load_file(file)
    tensors["mtp.fc.weight"] = torch.randn(64, 128)
    save_file(tensors, file, metadata={"format": "pt"})
    return model, path


def reference(prompt: list[int], new: int, tied: bool = False) -> tuple[int, ...]:
    model, _ = published(tied)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
    for logits in out.logits:
        top2 = logits[0].topk(2).values
        assert float(top2[0] - top2[1]) >= MIN_GAP, "ambiguous reference: change the seed"
    return tuple(out.sequences[0, len(prompt):].tolist())


def test_qwen3_5_as_published_generates_transformers_tokens(caplog):
    """Chunked prefill over several chunks and pages, decode, eager and the CPU graphs."""
    prompts = make_prompts([5, 30, 13], seed=4)
    want = [reference(p, 8) for p in prompts]
    params = ts.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for eager in (True, False):
        with caplog.at_level(logging.INFO, logger="tokenspeed.models.text_part"):
            llm = ts.LLM(str(published()[1]), page_size=4, max_num_batched_tokens=16, enforce_eager=eager)
        assert llm.model.config.architecture == "Qwen3_5ForCausalLM"
        got = [tuple(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
        assert got == want, f"enforce_eager={eager}"
    assert "the vision tower is not read" in caplog.text


def test_tied_embeddings_follow_the_outer_config_as_transformers_ties_them():
    """transformers ties a multimodal model's head by the outer ``tie_word_embeddings`` and
    writes text_config's default (False) beside it: the file holds no ``lm_head``."""
    _, path = published(tied=True)
    assert json.loads((path / "config.json").read_text())["text_config"]["tie_word_embeddings"] is False
    assert "lm_head.weight" not in load_file(next(path.glob("*.safetensors")))
    prompts = make_prompts([7, 19], seed=8)
    llm = ts.LLM(str(path), page_size=4, enforce_eager=True)
    assert llm.model.config.tie_word_embeddings
    params = ts.SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    got = [tuple(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == [reference(p, 6, tied=True) for p in prompts]


def test_a_multimodal_config_without_its_text_config_is_refused_by_name():
    path = new_tmpdir("ts_qwen3_5_no_text_")
    shutil.copytree(published()[1], path, dirs_exist_ok=True)
    config = json.loads((path / "config.json").read_text())
    del config["text_config"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelFileError, match="text_config"):
        load(path)


@pytest.mark.parametrize("variant, loads", [("qwen3_next", True), ("llama", False)])
def test_a_multi_token_prediction_head_is_left_unread_only_where_transformers_leaves_it(variant, loads):
    """Qwen3-Next's published ``mtp.*`` tensors load as transformers loads them (unread); in
    a model that has no such head they are still unexpected."""
    if variant not in VARIANTS:
        pytest.skip(f"transformers without {variant}")
    path = new_tmpdir(f"ts_{variant}_mtp_")
    shutil.copytree(checkpoint(variant), path, dirs_exist_ok=True)
    (file,) = path.glob("*.safetensors")
    tensors = load_file(file)
    tensors["mtp.fc.weight"] = torch.randn(4, 4)
    save_file(tensors, file, metadata={"format": "pt"})
    if loads:
        assert load(path).config.architecture == "Qwen3NextForCausalLM"
    else:
        with pytest.raises(ModelFileError, match="mtp.fc.weight"):
            load(path)
