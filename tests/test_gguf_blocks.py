"""GGUF weights kept in their blocks (``quantized=True``): which layers
keep them, what the graphs show, and tokens equal to the same file dequantized.

On the CPU the block layers run the CPU's block kernels (``cpu_blocks``: the same float32
weights as ``gguf``'s dequantization, summed in another order): tokens must be equal to the
dequantized model's, and the margins are checked so that the comparison means something.
The CUDA dispatch of each op is run here through the Triton interpreter.
"""

import logging

import attrs
import gguf
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import tokenspeed as ts
from tokenspeed.backends.kernels import cuda, reference
from tokenspeed.backends.kernels.gguf_blocks import SUPPORTED
from tokenspeed.ir.weights import BLOCK_FORMATS, GATHERED, BlockWeight, scatter_scales
from tokenspeed.models import gguf as ts_gguf
from tokenspeed.models.block_layers import BlockEmbedding, BlockLinear, gather_q8_0_head, gather_q8_0_scales
from tokenspeed.models.gguf_writer import write, write_llama
from tokenspeed.models.random import TINY_LLAMA, hf_state_dict

from hf_models import EOS, checkpoint, make_prompts, new_tmpdir
from margins import assert_decisive, decisive_model, greedy_margins
from test_gguf import K_LAYOUT, k_layout_file, metadata, random_blocks

Q = gguf.GGMLQuantizationType
GREEDY = ts.SamplingParams(temperature=0, max_tokens=8)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"   # the CUDA kernels' tensors
PROMPTS = make_prompts((5, 19), seed=5)


GATHERABLE = {**TINY_LLAMA, "hidden_size": 256, "intermediate_size": 384}   # K 256 gathers, 384 does not
WIDE_GATHERABLE = {**GATHERABLE, "vocab_size": 32768}   # a head of WIDE_ROWS rows or more: the loader's


def decisive_file(qtype, tied: bool = False, config=TINY_LLAMA) -> str:
    """``margins.decisive_model`` (clear greedy choices) written as llama.cpp writes a
    llama file, its matrices quantized to ``qtype``."""
    model = decisive_model(config={**config, "tie_word_embeddings": tied})
    path = new_tmpdir("ts_gguf_blocks_") / f"decisive-{qtype.name}-{config['hidden_size']}.gguf"
    return write_llama(path, attrs.evolve(model.config, eos_token_ids=(EOS,)), hf_state_dict(model), qtype)


def generate(model, prompts=PROMPTS):
    llm = ts.LLM(model, device="cpu", enforce_eager=True, max_model_len=256, page_size=4, max_num_seqs=4)
    return [o.token_ids for o in llm.generate(prompts, GREEDY)]


def block_layers(model) -> dict[str, str]:
    return {name: m.weight_format for name, m in model.named_modules()
            if isinstance(m, (BlockLinear, BlockEmbedding))}


def test_the_ir_names_the_formats_the_backends_read():
    assert BLOCK_FORMATS == tuple(q.name for q in SUPPORTED) + (GATHERED,)


# ---------------------------------------------------------------- loading


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_every_matrix_keeps_its_blocks_and_a_tied_head_reads_the_embedding(tied):
    path = decisive_file(Q.Q4_1, tied)
    model = ts.models.load(path, quantized=True)
    layers = block_layers(model)
    c = model.config
    assert len(layers) == 2 + 4 * c.num_layers  # qkv, o, gate_up, down and set(layers.values()) == {"Q4_1"}
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    assert all(p.dtype == torch.float32 for n, p in model.named_parameters() if "norm" in n)
    dense = sum(p.numel() * 4 for p in ts.models.load(path).parameters())
    assert sum(p.numel() * p.element_size() for p in model.parameters()) < dense / 5


def test_load_dequantizes_unless_asked():   # ts.LLM asks on the CPU (test_cpu_blocks.py)
    model = ts.models.load(decisive_file(Q.Q8_0))
    assert block_layers(model) == {} and all(p.dtype == torch.float32 for p in model.parameters())


def test_blocks_are_the_files_bytes_with_q_and_k_rows_unpermuted():
    """Each stacked part is the file's block rows, q and k put back in Hugging Face row
    order as whole rows: their dequantization is the dequantized model's slice."""
    path = decisive_file(Q.Q8_0)
    blocks, dense = ts.models.load(path, quantized=True), ts.models.load(path)
    for layer in ("self_attn.qkv_proj", "mlp.gate_up_proj", "self_attn.o_proj"):
        module = blocks.get_submodule(f"model.layers.1.{layer}")
        decoded = gguf.quants.dequantize(module.weight.detach().numpy(), Q.Q8_0)
        expected = dense.get_submodule(f"model.layers.1.{layer}").weight.detach().numpy()
        np.testing.assert_array_equal(decoded, expected, err_msg=layer)


@settings(max_examples=12, deadline=None, derandomize=True)
@given(qtype=st.sampled_from([Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1]), heads=st.integers(1, 4),
       pairs=st.integers(1, 4), blocks_per_row=st.integers(1, 3))
def test_unpermuting_block_rows_equals_unpermuting_the_dequantized_rows(qtype, heads, pairs, blocks_per_row):
    rows = np.random.default_rng(heads * pairs).standard_normal((heads * 2 * pairs, 32 * blocks_per_row))
    raw = gguf.quants.quantize(rows.astype(np.float32), qtype)
    unpermuted = ts_gguf.unpermute_rows(torch.from_numpy(raw), heads).numpy()
    expected = ts_gguf.unpermute_rows(torch.from_numpy(gguf.quants.dequantize(raw, qtype)), heads)
    np.testing.assert_array_equal(gguf.quants.dequantize(unpermuted, qtype), expected.numpy())


def test_a_stacked_projection_of_two_formats_keeps_each_parts_blocks(caplog, monkeypatch):
    """As a Q4_K_M file mixes Q4_K and Q6_K: the parts stay separate layers, unfused."""
    path, _ = k_layout_file(Q.Q4_K, matrix_type=Q.Q6_K)   # ffn_up Q6_K, ffn_gate Q4_K
    with caplog.at_level(logging.WARNING):
        model = ts.models.load(path, quantized=True)
    layers = block_layers(model)
    assert layers["model.layers.0.mlp.gate_up_proj.gate_proj"] == "Q4_K"
    assert layers["model.layers.0.mlp.gate_up_proj.up_proj"] == "Q6_K"
    assert layers["model.layers.0.self_attn.qkv_proj"] == "Q4_K"
    assert not [r for r in caplog.records if "dequantized at load" in r.getMessage()]
    prompts = make_prompts((3, 9), seed=2, vocab=K_LAYOUT["vocab"])
    margins = greedy_margins(monkeypatch)
    assert generate(model, prompts) == generate(ts.models.load(path), prompts)
    assert_decisive(margins)


def test_a_file_missing_a_part_of_a_two_format_projection_is_refused_naming_it():
    path, raw = k_layout_file(Q.Q4_K, matrix_type=Q.Q6_K)
    del raw["blk.0.ffn_up.weight"]
    norms = {n: np.ones(K_LAYOUT["hidden"], np.float32) for n in
             ("blk.0.attn_norm.weight", "blk.0.ffn_norm.weight", "output_norm.weight")}
    path = write(new_tmpdir("ts_gguf_blocks_") / "missing.gguf", "llama", metadata(*K_LAYOUT.values()),
                 {**raw, **norms})
    with pytest.raises(ValueError, match=r"missing tensors \['model.layers.0.mlp.up_proj.weight'\]"):
        ts.models.load(path, quantized=True)


def test_a_block_matrix_of_the_wrong_shape_is_refused_without_a_line_about_dequantizing(caplog):
    """The loader names the shape; the plan, which leaves that layer, says nothing of it
    (a probe found a dequantization warning before the shape error)."""
    path, raw = k_layout_file(Q.Q8_0)
    c = K_LAYOUT
    # half the columns: the rows are the head counts' (refused earlier, by those keys, if not)
    raw["blk.0.attn_q.weight"] = (random_blocks((c["heads"] * c["head_dim"], c["hidden"] // 2), Q.Q8_0, 7), Q.Q8_0)
    norms = {n: np.ones(c["hidden"], np.float32) for n in
             ("blk.0.attn_norm.weight", "blk.0.ffn_norm.weight", "output_norm.weight")}
    path = write(new_tmpdir("ts_gguf_blocks_") / "misshapen.gguf", "llama", metadata(*c.values()), {**raw, **norms})
    with caplog.at_level(logging.WARNING), pytest.raises(ValueError, match="q_proj.weight"):
        ts.models.load(path, quantized=True)
    assert not [r for r in caplog.records if "dequantized at load" in r.getMessage()]


def test_a_format_no_kernel_reads_is_dequantized_with_one_line_naming_it(caplog):
    path, _ = k_layout_file(Q.Q3_K)
    with caplog.at_level(logging.WARNING):
        model = ts.models.load(path, quantized=True)
    assert block_layers(model) == {}
    [line] = [r.getMessage() for r in caplog.records if "dequantized at load" in r.getMessage()]
    assert "9 Q3_K tensors (no kernel reads Q3_K)" in line


def test_quantized_asked_of_a_directory_is_refused():
    with pytest.raises(ValueError, match="only GGUF files keep quantized weights"):
        ts.models.load(checkpoint("llama"), quantized=True)


def test_a_block_weight_with_rows_of_another_count_is_refused():
    with pytest.raises(ValueError, match=r"must be uint8 \[4, row_bytes\]"):
        BlockWeight(torch.zeros(3, 34, dtype=torch.uint8), "Q8_0", (4, 32))


# ---------------------------------------------------------------- the graphs


def test_decode_graphs_show_one_linear_op_with_the_weights_format():
    model = ts.models.load(decisive_file(Q.Q4_0), quantized=True)
    decode = ts.trace(model).lower(mode="decode")
    text = decode.as_text()
    c = model.config
    assert text.count("tokenspeed.norm_linear(") == 2 * c.num_layers + 1  # qkv, gate_up; the head
    assert text.count("tokenspeed.gated_linear(") == c.num_layers           # down
    assert text.count("tokenspeed.linear(") == c.num_layers                 # o
    assert text.count("'Q4_0'") == 4 * c.num_layers + 2                 # and the embedding
    assert "tokenspeed.embedding(%input_ids, %embed_tokens_weight, 'Q4_0', 64, torch.float32)" in text


def test_an_eager_segment_zeroes_the_padding_of_its_rows_never_a_weight_it_passes_on():
    """The prefill encoder passes block weights on to later segments; the head of a
    32-token vocabulary has as many rows as the smallest token bucket. Zeroing padded
    outputs by their shape emptied it in the startup's dry walk (a Q4_K model's graphs then
    gave token 0 on the H200): only the outputs with a row per token row are zeroed."""
    from tokenspeed.execution.prefill_runner import _scrub
    from tokenspeed.ir.rows import rows_by_ladder
    model = ts.models.load(k_layout_file(Q.Q4_K)[0], quantized=True)
    lowered = ts.trace(model).lower(mode="prefill")
    encoder, narrowing = lowered.segments[:2]
    assert "lm_head_weight" in encoder.outputs and set(encoder.row_outputs) == {"embedding", "getitem"}
    assert narrowing.ladder == "view" and "narrow_embedding" in narrowing.row_outputs   # view rows
    follows = rows_by_ladder(lowered.program.graph_module, lowered.config)
    assert "embedding" in follows["tokens"] - follows["view"]
    assert "narrow_embedding" in follows["view"] - follows["tokens"]
    head = model.lm_head.weight
    assert head.shape[0] == K_LAYOUT["vocab"] == 32
    kept = head.clone()
    env = {name: torch.ones(32, 4) for name in encoder.row_outputs} | {"lm_head_weight": head}
    env |= {name: torch.ones(3) for name in encoder.outputs if name not in env}
    _scrub(encoder, env, 32, 5)
    assert torch.equal(head, kept)
    assert all(env[n][5:].eq(0).all() and env[n][:5].eq(1).all() for n in encoder.row_outputs)


# ---------------------------------------------------------------- tokens


@pytest.mark.parametrize("qtype, tied", [(Q.Q8_0, False), (Q.Q4_0, True), (Q.Q4_1, False), (Q.Q5_0, True)],
                         ids=["Q8_0", "Q4_0-tied", "Q4_1", "Q5_0-tied"])
def test_greedy_tokens_equal_the_dequantized_models(qtype, tied, monkeypatch):
    path = decisive_file(qtype, tied)
    margins = greedy_margins(monkeypatch)
    kept = generate(ts.models.load(path, quantized=True))
    assert_decisive(margins)
    assert kept == generate(ts.models.load(path)) and all(len(t) == GREEDY.max_tokens for t in kept)


def test_q8_0_regathered_gives_the_files_tokens(monkeypatch):
    """Every Q8_0 layer whose rows are whole runs of eight blocks is regathered (K 256 here,
    not the down projection's K 384); a tied head and its table stay one tensor. The GPU
    loader's choice, a head of ``WIDE_ROWS`` rows or more, takes none of this model's. Run
    here by the CPU's reference: the file's tokens."""
    path = decisive_file(Q.Q8_0, tied=True, config=GATHERABLE)
    margins = greedy_margins(monkeypatch)
    kept = generate(ts.models.load(path, quantized=True))
    assert_decisive(margins)
    assert set(block_layers(gather_q8_0_head(ts.models.load(path, quantized=True))).values()) == {"Q8_0"}
    gathered = gather_q8_0_scales(ts.models.load(path, quantized=True))
    formats = block_layers(gathered)
    assert {n for n, f in formats.items() if f == "Q8_0"} == {f"model.layers.{i}.mlp.down_proj" for i in range(2)}
    assert set(formats.values()) == {"Q8_0", GATHERED} and formats["lm_head"] == GATHERED
    assert gathered.lm_head.weight is gathered.model.embed_tokens.weight
    assert generate(gathered) == kept


@pytest.mark.parametrize("tied", [False, True])
def test_a_gpus_loader_regathers_a_wide_head_alone(tied):
    """The head (and its table, when tied: one tensor), not the narrower layers; the bytes
    are the file's, moved."""
    path = decisive_file(Q.Q8_0, tied=tied, config=WIDE_GATHERABLE)
    blocks = ts.models.load(path, quantized=True).lm_head.weight.detach().clone()
    model = gather_q8_0_head(ts.models.load(path, quantized=True))
    gathered = {n for n, f in block_layers(model).items() if f == GATHERED}
    assert gathered == ({"lm_head", "model.embed_tokens"} if tied else {"lm_head"})
    assert torch.equal(scatter_scales(model.lm_head.weight.detach()), blocks)


def test_greedy_tokens_of_a_q4_k_file_equal_the_dequantized_models(monkeypatch):
    """Random Q4_K blocks (``gguf`` cannot write K-quants) in a one-layer model."""
    path, _ = k_layout_file(Q.Q4_K)
    prompts = make_prompts((3, 9), seed=2, vocab=K_LAYOUT["vocab"])
    margins = greedy_margins(monkeypatch)
    kept = generate(ts.models.load(path, quantized=True), prompts)
    assert_decisive(margins)
    assert kept == generate(ts.models.load(path), prompts)


# ---------------------------------------------------------------- the CUDA dispatch


def blocks(qtype, rows: int, k: int, seed: int = 0) -> torch.Tensor:
    w = np.random.default_rng(seed).standard_normal((rows, k)).astype(np.float32)
    return torch.from_numpy(gguf.quants.quantize(w, qtype)).to(DEVICE)


@pytest.mark.parametrize("rows, norm_gemv_max_n", [(1, 4096), (1, 0), (3, 4096)])
def test_cuda_ops_read_the_blocks_as_the_reference_does(rows, norm_gemv_max_n, monkeypatch):
    """Each op's CUDA kernel (under the Triton interpreter on a CPU) with a block weight: the GEMV
    forms for one row (the norm fused into the GEMV, or for wide weights run before it), the
    matmul for more; fp32 sums in another order than the reference."""
    from tokenspeed.backends.kernels import triton_gguf_gemv
    fused, norm_gemv = [], triton_gguf_gemv.norm_gemv
    monkeypatch.setattr(cuda, "GGUF_NORM_GEMV_MAX_N", norm_gemv_max_n)
    monkeypatch.setattr(triton_gguf_gemv, "norm_gemv", lambda *a, **k: fused.append(1) or norm_gemv(*a, **k))
    torch.manual_seed(0)
    k, n = 64, 40
    weight, x = blocks(Q.Q4_1, n, k), torch.randn(rows, k, device=DEVICE)
    gate_up, residual = torch.randn(rows, 2 * k, device=DEVICE), torch.randn(rows, k, device=DEVICE)
    norm_weight, bias = torch.rand(k, device=DEVICE), torch.randn(n, device=DEVICE)
    calls = [("linear", (x, weight, bias, "Q4_1")), ("gated_linear", (gate_up, weight, None, "Q4_1")),
             ("norm_linear", (x, residual, norm_weight, 1e-6, weight, bias, "Q4_1")),
             ("norm_linear", (x, None, norm_weight, 1e-6, weight, None, "Q4_1"))]
    for name, args in calls:
        got, expected = as_list(getattr(cuda, name)(*args)), as_list(getattr(reference, name)(*args))
        assert len(got) == len(expected)
        for g, e in zip(got, expected):
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-4, msg=name)
    assert len(fused) == (2 if rows == 1 and n <= norm_gemv_max_n else 0)  # both norm_linear calls


def as_list(out) -> list:
    return out if isinstance(out, list) else [out]


def test_cuda_embedding_gathers_decoded_rows_in_the_asked_dtype():
    """Exact in float32; bfloat16 within a rounding (the interpreter may truncate)."""
    table, ids = blocks(Q.Q8_0, 10, 64), torch.tensor([3, 0, 9, 3], device=DEVICE)
    expected = reference.embedding(ids, table, "Q8_0", 64, torch.float32)
    assert torch.equal(cuda.embedding(ids, table, "Q8_0", 64, torch.float32), expected)
    got = cuda.embedding(ids, table, "Q8_0", 64, torch.bfloat16)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected, rtol=2 ** -7, atol=0)


# ---------------------------------------------------------------- on the GPU


def cuda_llm(model, **kw):
    return ts.LLM(model, device="cuda", **{"max_model_len": 256, "max_num_seqs": 4,
                                          "gpu_memory_utilization": 0.2, **kw})


@pytest.mark.gpu
@pytest.mark.parametrize("qtype, config", [(Q.Q8_0, TINY_LLAMA), (Q.Q8_0, WIDE_GATHERABLE), (Q.Q4_K, None)],
                         ids=["Q8_0", "Q8_0_G8", "Q4_K"])
def test_gpu_tokens_with_graphs_equal_the_dequantized_models(qtype, config, monkeypatch):
    """float32 activations on both sides; the quantized model runs its captured graphs (the
    GGUF GEMV at batch 1..4, the matmul in prefill), the dequantized one eagerly, its
    margins checked. A Q8_0 file's head of ``WIDE_ROWS`` rows or more runs Q8_0_G8
    (the wide GEMV at batch 1, the matmul's groups for more rows)."""
    path = decisive_file(qtype, config=config) if qtype != Q.Q4_K else k_layout_file(qtype)[0]
    vocab = K_LAYOUT["vocab"] if qtype == Q.Q4_K else TINY_LLAMA["vocab_size"]
    seed = 1 if config is WIDE_GATHERABLE else 2   # margins above MIN_MARGIN (the wide head's seed 2: 6e-4)
    prompts = make_prompts((3, 9, 17, 30), seed=seed, vocab=vocab)
    kept = ts.models.load(path, dtype=torch.float32, device="cuda", quantized=True)
    formats = block_layers(kept)
    assert formats and {n for n, f in formats.items() if f == GATHERED} == (
        {"lm_head"} if config is WIDE_GATHERABLE else set())
    tokens = [o.token_ids for o in cuda_llm(kept).generate(prompts, GREEDY)]
    margins = greedy_margins(monkeypatch)
    dense = ts.models.load(path, dtype=torch.float32, device="cuda", quantized=False)
    assert tokens == [o.token_ids for o in cuda_llm(dense, enforce_eager=True).generate(prompts, GREEDY)]
    assert_decisive(margins)


@pytest.mark.gpu
def test_gpu_default_model_answers_the_readme_chat_the_same_quantized_and_dequantized():
    """The README's greedy chat on the embedded SmolLM2 (Q4_1, its embedding Q8_0), in
    bfloat16; the blocks take well under half of bfloat16's bytes."""
    try:
        path = ts.models.default_model_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    chat = [{"role": "user", "content": "What is 2 + 2?"}]
    greedy = ts.SamplingParams(temperature=0, max_tokens=32)
    blocks = ts.models.load(path, dtype=torch.bfloat16, device="cuda", quantized=True)
    assert set(block_layers(blocks).values()) == {"Q4_1", "Q8_0"}
    answer, kept_bytes = cuda_llm(blocks, tokenizer=str(path)).chat(chat, greedy)[0].text, weight_bytes(blocks)
    del blocks
    dense = ts.models.load(path, dtype=torch.bfloat16, device="cuda", quantized=False)
    assert kept_bytes < 0.5 * weight_bytes(dense)
    assert cuda_llm(dense, tokenizer=str(path)).chat(chat, greedy)[0].text == answer and "4" in answer


def weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def test_prefill_sized_rows_decode_the_weight_whole_as_the_reference_does():
    """From ``GGUF_DEQUANTIZED_ROWS`` rows the weight is decoded for cuBLAS (under the
    Triton interpreter on a CPU): the same products as the reference, in another order."""
    torch.manual_seed(1)
    weight, bias = blocks(Q.Q8_0, 40, 64), torch.randn(40, device=DEVICE)
    x = torch.randn(cuda.GGUF_DEQUANTIZED_ROWS + 3, 64, device=DEVICE)
    torch.testing.assert_close(cuda.linear(x, weight, bias, "Q8_0"), reference.linear(x, weight, bias, "Q8_0"),
                               rtol=1e-5, atol=1e-4)


def checked_against_reference(kernels, monkeypatch) -> list[str]:
    """Every GGUF-weight op of ``kernels`` (a kernel module) wrapped to compare its output
    with the reference on the same arguments, as the model's steps call it; returns the
    list the mismatches (op, format, input shape and strides, error) are added to."""
    mismatches = []

    def checked(name):
        kernel, oracle = getattr(kernels, name), getattr(reference, name)

        def run(*args, **kwargs):   # kwargs: the step's split counters
            out = kernel(*args, **kwargs)
            if any(a in BLOCK_FORMATS for a in args if isinstance(a, str)):
                for got, want in zip(as_list(out), as_list(oracle(*args, **kwargs))):
                    error = (got.float() - want.float()).abs().max().item() if want.numel() else 0.0
                    if error > 1e-3 * max(1.0, want.abs().max().item()):
                        x = args[0]
                        mismatches.append(f"{name} {[a for a in args if isinstance(a, str)]} x "
                                          f"{tuple(x.shape)} strides {x.stride()}: error {error:.3g}")
            return out
        return run

    for name in ("linear", "gated_linear", "norm_linear", "embedding"):
        monkeypatch.setattr(kernels, name, checked(name))
    return mismatches


@pytest.mark.skipif(torch.cuda.is_available(), reason="the Triton interpreter's run on CPU tensors; on a GPU "
                    "test_gpu_each_block_op_of_a_model_step_matches_the_reference covers it")
def test_each_block_op_of_a_model_step_matches_the_reference_through_the_cuda_kernels(monkeypatch):
    """The CUDA kernels (under the Triton interpreter) on the model's own activations,
    every op compared as the steps run it: tokens equal the dequantized model's."""
    path = decisive_file(Q.Q8_0)
    prompts = make_prompts((3, 9), seed=7, vocab=TINY_LLAMA["vocab_size"])
    want = generate(ts.models.load(path), prompts)
    mismatches = checked_against_reference(cuda, monkeypatch)
    for name in ("linear", "gated_linear", "norm_linear", "embedding"):   # the CPU runs them
        monkeypatch.setattr(reference, name, getattr(cuda, name))
    assert generate(ts.models.load(path, quantized=True), prompts) == want
    assert not mismatches, mismatches


@pytest.mark.gpu
def test_gpu_each_block_op_of_a_model_step_matches_the_reference(monkeypatch):
    """On the GPU, eagerly: a mismatch names the op, the format and the input's shape and
    strides as the model's steps call it (where the graphs' tokens differ, this says why)."""
    path = decisive_file(Q.Q8_0)
    prompts = make_prompts((3, 9, 17), seed=7, vocab=TINY_LLAMA["vocab_size"])
    mismatches = checked_against_reference(cuda, monkeypatch)
    kept = ts.models.load(path, dtype=torch.float32, device="cuda", quantized=True)
    tokens = [o.token_ids for o in cuda_llm(kept, enforce_eager=True).generate(prompts, GREEDY)]
    assert not mismatches, mismatches
    dense = ts.models.load(path, dtype=torch.float32, device="cuda")
    assert tokens == [o.token_ids for o in cuda_llm(dense, enforce_eager=True).generate(prompts, GREEDY)]
