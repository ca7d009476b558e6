"""A tiny random Llama that speaks through a real tokenizer: SmolLM2's vocabulary, chat
template and special tokens (from the default GGUF) over a two-layer model, saved as a
Hugging Face directory. Built once per process; not a test module.

The weights are random, so the text is nonsense, but every token id is real text and the
tests that need words (stop strings, detokenization, chat) get them quickly.
"""

import functools
import json
import os

import pytest

from hf_models import new_tmpdir
from margins import decisive_model

SMOL_VOCAB = 49152
TEXT_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": SMOL_VOCAB, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "max_position_embeddings": 512,
    "rope_theta": 10000.0, "tie_word_embeddings": False, "dtype": "float32",
    "bos_token_id": 1, "eos_token_id": 2,
}


def smol_tokenizer():
    """The default model's tokenizer; ``TOKENSPEED_TEST_TOKENIZER`` names a copy of it (a
    directory) on a machine without the model's 98 MB file, such as the GPU machine."""
    from tokenspeed.models import default_model_path
    from tokenspeed.tokenizer import load_tokenizer
    try:
        return load_tokenizer(os.environ.get("TOKENSPEED_TEST_TOKENIZER") or default_model_path())
    except FileNotFoundError as exc:
        pytest.skip(str(exc))


@functools.lru_cache(maxsize=None)
def text_model_dir():
    """The directory: config.json, model.safetensors, tokenizer.json, tokenizer_config.json."""
    from safetensors.torch import save_file

    from tokenspeed.models.random import hf_state_dict
    tokenizer = smol_tokenizer()
    if tokenizer.chat_template is None:   # the chat tests read it
        raise ValueError("the test tokenizer has no chat template: TOKENSPEED_TEST_TOKENIZER must name a copy "
                         "of the default model's tokenizer whose tokenizer_config.json holds its chat_template")
    path = new_tmpdir("ts_text_llama_")
    save_file(hf_state_dict(decisive_model(seed=5, config=TEXT_LLAMA)), str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(TEXT_LLAMA))
    tokenizer.backend.save(str(path / "tokenizer.json"))
    special = tokenizer.special
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": special.bos_token, "eos_token": special.eos_token,
        "unk_token": special.unk_token, "chat_template": tokenizer.chat_template.source}))
    return path


def llm_failing_on(path: str, poison: int, **options):
    """An ``LLM`` of ``path`` whose step raises while a prompt holding the token ``poison``
    is queued: a stand-in for a kernel that falls over, built inside a server's engine
    process (a module-level function, so the engine spec pickles)."""
    import tokenspeed as ts
    llm = ts.LLM(path, **options)
    engine, step = llm.engine, llm.engine.step

    def failing_step():
        queued = list(engine.scheduler.running) + list(engine.scheduler.waiting)
        if any(poison in r.prompt for r in queued):
            raise RuntimeError("a kernel fell over")
        return step()
    engine.step = failing_step
    return llm
