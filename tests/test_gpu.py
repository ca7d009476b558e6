"""The graph equalities with real CUDA graphs, and Hugging Face parity on the GPU."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import tokenspeed as ts
from tokenspeed.backends.metadata import DecodeRow, ExtendChunk
from tokenspeed.models.random import TINY_LLAMA, random_model
from tokenspeed.execution.graphs import MovedTensorError
from tokenspeed.execution.sampler import RowSampling

pytestmark = pytest.mark.gpu
GREEDY = ts.SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
MID = {**TINY_LLAMA, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
       "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 1024}


def prompts(n):
    return [[(3 + 11 * i + j) % 500 for j in range(2 + 9 * i)] for i in range(n)]


def llm(model, **kw):
    return ts.LLM(model, device="cuda", **{"page_size": 16, "max_num_seqs": 10, "max_num_batched_tokens": 128,
                                          "max_model_len": 512, **kw})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_graph_replay_equals_eager(dtype):
    """Same cache, same rows: a replay padded to its rung and an unpadded eager step sample
    identical tokens (the decode kernels are batch-invariant), above the ladder too."""
    model = random_model(MID, seed=5).to("cuda", dtype)
    graphs, eager = llm(model, capture_sizes=(1, 2, 4, 8)), llm(model, enforce_eager=True)
    assert graphs.compiled.decode.graphs and not eager.compiled.decode.graphs
    greedy = ts.SamplingParams(temperature=0.0)
    with torch.inference_mode():
        for bs in range(1, 11):  # rungs, between rungs, above the ladder
            rows = _prefilled(eager, bs)
            graphs.compiled.kv_cache.copy_(eager.compiled.kv_cache)
            for _ in range(4):
                got = graphs.compiled.decode.run(rows, [RowSampling(greedy, 0)] * bs)
                want = eager.compiled.decode.run(rows, [RowSampling(greedy, 0)] * bs)
                assert got == want, f"bs={bs}"
                rows = [DecodeRow(t, r.position + 1, r.pages) for t, r in zip(want, rows)]


def test_each_decode_graph_knows_the_kernels_it_launches():
    """The driver's count of a graph's kernel nodes is what the profiler sees an eager step
    of that rung launch (no rung of this model copies or sets memory in its step), and
    ``as_text`` prints it by rung with the count a layer."""
    engine = llm(random_model(MID, seed=5).to("cuda", torch.bfloat16), capture_sizes=(1, 2, 4))
    graphs = engine.compiled.decode.graphs
    for bs, graph in graphs.items():
        assert graph.kernels == engine.compiled.kernels_per_step(bs) > MID["num_hidden_layers"], bs
    text = engine.compiled.as_text()
    counts = ", ".join(f"{bs}: {graphs[bs].kernels}" for bs in (1, 2, 4))
    assert f"kernels a step, by rows: {counts} ({graphs[1].kernels / 4:.1f} a layer at 1 rows over 4 layers" in text


def _prefilled(engine, bs):
    rows, per = [], 6  # pages of 16 for the longest prompt (83 tokens) and 4 decode steps
    for i, p in enumerate(prompts(bs)):
        pages = tuple(range(1 + i * per, 1 + (i + 1) * per))
        [token] = engine.compiled.prefill.run([ExtendChunk(tuple(p), 0, pages, True)], [RowSampling(GREEDY, 0)])
        rows.append(DecodeRow(token, len(p), pages))
    return rows


def test_float32_generation_with_graphs_equals_eager():
    """Whole generations (breakable prefill graphs + decode graphs) against the eager path.
    In bfloat16 only the decode path is compared token for token (above): cuBLAS may choose
    another algorithm for a prefill matrix product under capture, and random-weight bf16
    logits are full of near-ties."""
    model = random_model(MID, seed=5).to("cuda")
    graphs, eager = llm(model, capture_sizes=(1, 2, 4, 8)), llm(model, enforce_eager=True)
    for n in (1, 3, 8, 10):
        assert [o.token_ids for o in graphs.generate(prompts(n), GREEDY)] == \
            [o.token_ids for o in eager.generate(prompts(n), GREEDY)], f"{n} prompts"


@pytest.mark.parametrize("enforce_eager", [False, True])
def test_a_prefill_launch_queues_its_work_without_waiting_for_the_gpu(enforce_eager):
    """Behind work the GPU is still running, launching a prefill step (its metadata, its
    forward and its sampling settings) returns with the stream still busy: a copy from
    pageable memory would first have waited for it. Its tokens are those of an idle GPU's."""
    engine = llm(random_model(MID, seed=5).to("cuda"), enforce_eager=enforce_eager)
    chunks, sampling = [ExtendChunk(tuple(range(10, 40)), 0, (1, 2), True)], [RowSampling(GREEDY, 0)]
    with torch.inference_mode():                   # as the engine steps
        want = engine.compiled.prefill.run(chunks, sampling)
        torch.cuda._sleep(1 << 30)                 # about half a second of the GPU's time
        future = engine.compiled.prefill.launch(chunks, sampling)
        assert not torch.cuda.current_stream().query()
        assert future.tokens() == want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kw", [{}, {"max_num_seqs": 2, "max_num_batched_tokens": 16}])
def test_overlapped_decoding_equals_the_synchronous_loop(dtype, kw):
    """With ``kw``, prompts wait for seats and are computed in chunks, so extend batches
    chain onto the step in flight, their decode rows fed on the device."""
    model = random_model(MID, seed=5).to("cuda", dtype)
    on, off = llm(model, overlap=True, **kw), llm(model, overlap=False, **kw)
    params = [ts.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (12, 3, 9, 16, 1)]
    assert [o.token_ids for o in on.generate(prompts(5), params)] == \
        [o.token_ids for o in off.generate(prompts(5), params)]


def test_float32_tokens_match_hugging_face():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256,
                                      num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=512)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).to("cuda").eval()
    from tokenspeed.models.config import ModelConfig
    from tokenspeed.models.loader import build, load_state_dict
    ours = build(ModelConfig.from_hf({**config.to_dict(), "architectures": ["LlamaForCausalLM"]}),
                 torch.float32, "cuda")
    load_state_dict(ours, hf.state_dict())
    params = ts.SamplingParams(temperature=0.0, max_tokens=10)
    got = llm(ours).generate(prompts(5), params)
    for p, out in zip(prompts(5), got):
        ref = hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=10, do_sample=False)
        assert list(out.token_ids) == ref[0, len(p):].tolist()[:len(out.token_ids)]


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
@pytest.mark.parametrize("arch, windows", [("mistral", dict(sliding_window=16)),
                                           ("qwen3", dict(use_sliding_window=True, sliding_window=24,
                                                          layer_types=["sliding_attention", "full_attention",
                                                                       "sliding_attention"]))])
def test_float32_sliding_windows_match_hugging_face(arch, windows, enforce_eager):
    """Windows a fraction of the prompts (up to 137 tokens) and of the decode, through the
    Triton kernels and captured graphs."""
    transformers = pytest.importorskip("transformers")
    classes = {"mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, "MistralForCausalLM"),
               "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, "Qwen3ForCausalLM")}
    config_cls, model_cls, name = classes[arch]
    config = config_cls(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                        **windows)
    torch.manual_seed(0)
    hf = model_cls(config).to("cuda").eval()
    from tokenspeed.models.config import ModelConfig
    from tokenspeed.models.loader import build, load_state_dict
    ours = build(ModelConfig.from_hf({**config.to_dict(), "architectures": [name]}), torch.float32, "cuda")
    load_state_dict(ours, hf.state_dict())
    params = ts.SamplingParams(temperature=0.0, max_tokens=40)
    got = llm(ours, enforce_eager=enforce_eager).generate(prompts(16), params)
    for p, out in zip(prompts(16), got):
        ref = hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=40, do_sample=False)
        assert list(out.token_ids) == ref[0, len(p):].tolist()[:len(out.token_ids)]


def test_guard_catches_a_moved_tensor_in_debug_mode(monkeypatch):
    monkeypatch.setenv("TOKENSPEED_GRAPH_DEBUG", "1")
    engine = llm(random_model(MID).to("cuda"))
    view = engine.compiled.decode.slots.view(1)
    view["slot_mapping"] = view["slot_mapping"].clone()
    with pytest.raises(MovedTensorError, match="meta.slot_mapping"):
        engine.generate(prompts(1), GREEDY)


PRECOMPILE_CHECK = textwrap.dedent("""
    import json, os, torch, tokenspeed as ts
    from tokenspeed.models.random import TINY_LLAMA, random_model
    from tokenspeed.execution import startup
    cache, seen = os.environ["TRITON_CACHE_DIR"], []
    compile = startup.precompile.CompileWorkers.compile
    def compile_and_look(workers, variants):
        ok = compile(workers, variants)
        seen.append(set(os.listdir(cache)))
        return ok
    startup.precompile.CompileWorkers.compile = compile_and_look
    llm = ts.LLM(random_model(TINY_LLAMA).to("cuda", torch.bfloat16), device="cuda",
                 max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256, compile_workers=3)
    new = set(os.listdir(cache)) - seen[0] if seen else set()
    print(json.dumps([llm.compiled.startup.kernel_variants_precompiled, sorted(new)]))
""")


def test_workers_compile_every_kernel_the_captures_launch(tmp_path):
    """With an empty Triton cache, the captures after the parallel compile add nothing to
    the cache but the marker: every variant they launch (and its launcher) was recorded and
    compiled. A second start finds the marker and compiles nothing in workers."""
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path)}
    runs = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", PRECOMPILE_CHECK], env=env, capture_output=True,
                              text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    (compiled, new), (again, _) = runs
    assert compiled > 0 and again == 0
    assert [n for n in new if not n.startswith("tokenspeed-precompiled-")] == [], new
