"""``gguf_writer.write_llama``: a model written as llama.cpp writes a ``llama`` file reads
back as the same model (Llama 3 rope scaling as ``rope_freqs.weight``, a tied head as no
``output.weight``), its matrices in the type asked, random blocks for the K-quants."""

import attrs
import gguf
import pytest
import torch

import tokenspeed as ts
from tokenspeed.models.gguf_writer import write_llama
from tokenspeed.models.random import TINY_LLAMA, hf_state_dict, random_model

from hf_models import new_tmpdir

Q = gguf.GGMLQuantizationType
LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
ROWS_OF_256 = {**TINY_LLAMA, "vocab_size": 32, "hidden_size": 256, "intermediate_size": 256}  # K-quant rows


def written(config: dict, qtype) -> tuple[torch.nn.Module, str]:
    model = random_model(config)
    return model, write_llama(new_tmpdir("ts_gguf_writer_") / f"{qtype}.gguf", model.config,
                              hf_state_dict(model), qtype)


def test_an_f32_file_reads_back_as_the_model_with_its_rope_scaling_and_tied_head():
    model, path = written({**TINY_LLAMA, "tie_word_embeddings": True, "rope_parameters": LLAMA3,
                           "eos_token_id": 2}, "F32")
    loaded = ts.models.load(path)
    assert attrs.evolve(loaded.config, rope_scaling=None) == attrs.evolve(model.config, rope_scaling=None)
    assert loaded.config.rope_scaling.factor == 8.0 and loaded.config.eos_token_ids == (2,)
    torch.testing.assert_close(loaded.model.layers[0].self_attn.rotary.inv_freq,
                               model.model.layers[0].self_attn.rotary.inv_freq, rtol=1e-5, atol=0)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    state, expected = loaded.state_dict(), model.state_dict()
    assert state.keys() == expected.keys() and all(torch.equal(state[n], expected[n]) for n in state)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K", "Q6_K"])
def test_every_matrix_is_stored_in_the_type_asked_and_every_vector_f32(qtype):
    _, path = written(ROWS_OF_256, qtype)
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(path).tensors}
    assert "output.weight" in types and "rope_freqs.weight" not in types
    assert {t for n, t in types.items() if "norm" not in n} == {Q[qtype]}
    assert {t for n, t in types.items() if "norm" in n} == {Q.F32}
    kept = ts.models.load(path, quantized=True)
    assert {m.weight_format for m in kept.modules() if hasattr(m, "weight_format")} == {qtype}


def test_a_type_without_a_writer_or_another_architecture_is_refused():
    model = random_model(TINY_LLAMA)
    with pytest.raises(ValueError, match="GGUF type IQ4_NL cannot be written; writable: F32, F16, BF16, Q8_0"):
        write_llama(new_tmpdir() / "x.gguf", model.config, hf_state_dict(model), "IQ4_NL")
    qwen = attrs.evolve(model.config, architecture="Qwen2ForCausalLM")
    with pytest.raises(ValueError, match="write_llama writes LlamaForCausalLM models; got Qwen2ForCausalLM"):
        write_llama(new_tmpdir() / "x.gguf", qwen, hf_state_dict(model), "Q8_0")


def test_a_file_without_a_tokenizer_names_the_ways_to_run_it():
    """``write_llama`` writes no tokenizer: the refusal says how to give one or run token
    ids, and the second way runs."""
    _, path = written(TINY_LLAMA, "F32")
    with pytest.raises(ValueError, match=r"no tokenizer in this GGUF .*tokenizer=.*ts.LLM\(ts.models.load\(path\)\)"):
        ts.LLM(path)
    out = ts.LLM(ts.models.load(path)).generate([[1, 2, 3]], ts.SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(out[0].token_ids) == 2


def test_a_split_model_is_refused_by_its_parts_not_by_missing_tensors(monkeypatch):
    """llama.cpp's ``gguf-split`` parts (``-00001-of-00003.gguf``, as large models are
    published): each part, the first too, is refused naming the split and the merge."""
    from tokenspeed.models import gguf_writer
    whole = gguf.GGUFWriter
    monkeypatch.setattr(gguf_writer.gguf, "GGUFWriter", lambda path, arch: whole(path, arch, split_max_tensors=8))
    model = random_model(TINY_LLAMA)
    folder = new_tmpdir("ts_gguf_split_")
    write_llama(folder / "tiny.gguf", model.config, hf_state_dict(model), "Q8_0")
    parts = sorted(folder.glob("tiny-*-of-00003.gguf"))
    assert len(parts) == 3
    for number, part in enumerate(parts, 1):
        with pytest.raises(ValueError, match=rf"part {number} of 3 of a split GGUF model \(split.count=3\).*"
                                             rf"llama-gguf-split --merge"):
            ts.models.load(part)
    with pytest.raises(ValueError, match="part 1 of 3 of a split GGUF model"):
        ts.LLM(parts[0])
