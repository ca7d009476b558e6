"""Hybrid models (Qwen3-Next, Qwen3.5: gated-DeltaNet layers beside gated attention): the config's
fields and refusals, the state pools, the lowered IR (decode's one-row forms, prefill's
recurrent breaks on every row), the rows' state slots, what ts.LLM refuses, and prefix
caching through state checkpoints (their bookkeeping over the engine loop:
tests/test_state_checkpoints.py).

Greedy token identity with transformers (default settings, chunked prefill, oversubscribed
and preempted pools, graphs on the CPU stand-in) runs in tests/test_hf_parity.py, the
``qwen3_next`` and ``qwen3_5`` variants; the ops against transformers in tests/test_state_ops.py.
"""

import functools

import pytest
import torch
from hypothesis import given, settings, strategies as st

import tokenspeed as ts
from tokenspeed import stages
from tokenspeed.execution.compile_config import CompileConfig
from tokenspeed.backends.metadata import NULL_SLOT, DecodeRow, ExtendChunk, plan_extend, refresh_decode
from tokenspeed.ir.ops import CAUSAL_CONV_SILU, GATED_DELTA_RULE
from tokenspeed.models.config import ModelConfig
from tokenspeed.models.loader import load

from hf_models import VARIANTS, checkpoint, hf_config, make_prompts, reference
from margins import assert_decisive, greedy_margins

VARIANT = "qwen3_next"
HAS_CUDA = torch.cuda.is_available()


def config_dict(**changes) -> dict:
    hf = hf_config(VARIANT).to_dict()
    hf["architectures"] = ["Qwen3NextForCausalLM"]
    hf.update(changes)
    return {k: v for k, v in hf.items() if v is not None}


def test_the_config_names_linear_layers_heads_and_the_partial_rotary():
    config = ModelConfig.from_hf(config_dict())
    linear = config.hybrid.linear
    assert linear.layers == (0, 2) and config.attention_layers == (1,)
    assert (linear.num_key_heads, linear.num_value_heads, linear.key_head_dim, linear.value_head_dim) == (2, 4, 16, 16)
    assert config.hybrid.rotary_dim == 8 and config.hybrid.shared_expert_size == 40
    assert config.moe.sparse_layers == (0, 1) and config.moe.normalize_top_k
    assert [g.layers for g in config.cache_groups] == [(1,)]   # pages only for the attention layer


@pytest.mark.skipif("qwen3_5" not in VARIANTS, reason="transformers without Qwen3.5")
def test_qwen3_5_has_dense_mlps_and_its_linear_projections_laid_out_whole():
    config = ModelConfig.from_hf({**hf_config("qwen3_5").to_dict(), "architectures": ["Qwen3_5ForCausalLM"]})
    assert config.moe is None and not config.hybrid.linear.by_key_head and config.hybrid.linear.layers == (0, 2)
    params = dict(load(checkpoint("qwen3_5")).named_parameters())
    assert params["model.layers.0.linear_attn.in_proj_qkvz.weight"].shape == (2 * 32 + 64 + 64, 64)
    assert params["model.layers.0.linear_attn.in_proj_ba.weight"].shape == (8, 64)


def test_without_layer_types_every_fourth_layer_attends_as_in_transformers():
    config = ModelConfig.from_hf(config_dict(layer_types=None, num_hidden_layers=8, mlp_only_layers=[]))
    assert config.attention_layers == (3, 7)


@pytest.mark.parametrize("changes, named", [
    (dict(layer_types=["linear_attention"] * 3), "layer_types"),
    (dict(layer_types=["linear_attention", "sliding_attention", "full_attention"]), "layer_types"),
    (dict(linear_num_value_heads=3), "linear_num_value_heads"),
    (dict(linear_conv_kernel_dim=0), "linear_conv_kernel_dim"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 3000.0, "partial_rotary_factor": 1.5}),
     "partial_rotary_factor"),
    (dict(sliding_window=8, use_sliding_window=True), "sliding_window"),
    (dict(hidden_act="gelu"), "hidden_act"),
])
def test_fields_that_cannot_be_honoured_are_refused_by_name(changes, named):
    with pytest.raises(ValueError, match=named):
        ModelConfig.from_hf(config_dict(**changes))


@pytest.mark.parametrize("prefix_caching, slots", [(False, 6), (True, 11)])
def test_the_state_pools_get_a_slot_per_sequence_and_keep_the_recurrence_float32(prefix_caching, slots):
    """The null slot and 5 seats; with prefix caching 5 checkpoint slots after them."""
    llm = ts.LLM(checkpoint(VARIANT), dtype=torch.bfloat16, max_num_seqs=5, enforce_eager=True,
                 enable_prefix_caching=prefix_caching)
    pools = llm.model.model.state_pools
    assert pools.conv.shape == (2, slots, 2 * 32 + 64, 4) and pools.conv.dtype == torch.bfloat16
    assert pools.recurrent.shape == (2, slots, 4, 16, 16) and pools.recurrent.dtype == torch.float32
    checkpoints = llm.engine.scheduler.checkpoints
    assert (checkpoints.first_slot, checkpoints.count) == (6, 5) if prefix_caching else checkpoints is None


def test_state_pools_beyond_the_gpus_share_are_refused_naming_max_num_seqs(monkeypatch):
    """Checked before they are allocated: 40 MiB a sequence on a device of 80 GiB that holds
    20 (weights) leaves 52 GiB at gpu_memory_utilization=0.9."""
    from tokenspeed.api.hybrid_setup import check_states_fit
    gib, cuda = 2 ** 30, torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (60 * gib, 80 * gib))
    check_states_fit(cuda, 129, 40 * 2 ** 20, 64, 0.9, True)                        # 5 GiB: fits
    check_states_fit(torch.device("cpu"), 10 ** 6, 40 * 2 ** 20, 10 ** 6, 0.9, True)  # not a GPU: no share
    with pytest.raises(ValueError, match=r"max_num_seqs=1024: .* 2049 slots .*gpu_memory_utilization=0.9 .*"
                                         r"prefix caching off"):
        check_states_fit(cuda, 2049, 40 * 2 ** 20, 1024, 0.9, True)
    with pytest.raises(ValueError, match=r"lower max_num_seqs$"):
        check_states_fit(cuda, 1400, 40 * 2 ** 20, 1399, 0.9, False)


def test_decode_reads_one_row_a_request_and_prefill_runs_the_recurrence_on_every_row():
    traced = ts.trace(load(checkpoint(VARIANT)))
    decode = traced.lower("decode").program
    steps = [n.target.name() for n in decode.graph_module.graph.nodes if n.op == "call_function" and
             "tokenspeed" in str(n.target)]
    assert steps.count("tokenspeed::causal_conv_silu_step") == 2
    assert steps.count("tokenspeed::gated_delta_rule_step") == 2
    assert "tokenspeed::gated_delta_rule" not in steps
    prefill = traced.lower("prefill").program
    recurrent = [n for n in prefill.graph_module.graph.nodes if n.target in (CAUSAL_CONV_SILU, GATED_DELTA_RULE)]
    assert len(recurrent) == 4 and all(n.meta["stage"] == "encoder" for n in recurrent)
    breaks = [s for s in prefill.segments if s.name.endswith(".recurrent")]
    assert len(breaks) == 4 and all(s.kind == "break" for s in breaks)
    assert "state_slots" in traced.as_text()


def test_pools_too_small_for_max_num_seqs_are_refused_before_anything_is_bound():
    traced = ts.trace(load(checkpoint(VARIANT)))   # traced by hand: the pools hold the null slot only
    with pytest.raises(ValueError, match=r"max_num_seqs=4.*allocate\(5\)"):
        stages.compile(traced.lower("prefill"), traced.lower("decode"), CompileConfig(max_num_seqs=4))


def test_a_model_without_recurrent_layers_reads_no_state_slots():
    assert "state_slots" not in ts.trace(load(checkpoint("qwen3"))).as_text()


@settings(max_examples=25, deadline=None, derandomize=True)
@given(seats=st.lists(st.integers(1, 64), min_size=1, max_size=6, unique=True),
       lengths=st.lists(st.integers(1, 9), min_size=6, max_size=6), padding=st.integers(0, 5))
def test_every_row_reads_its_requests_seat_and_padding_the_null_slot(seats, lengths, padding):
    lengths = lengths[:len(seats)]
    chunks = [ExtendChunk(tuple(range(n)), 0, (1 + i,) * 3, True, seat=s)
              for i, (n, s) in enumerate(zip(lengths, seats))]
    rows = sum(lengths)
    extend = plan_extend(chunks, rows + padding, len(chunks) + 1, 3, 4)
    expected = [s for n, s in zip(lengths, seats) for _ in range(n)] + [NULL_SLOT] * padding
    assert extend.state_slots.tolist() == expected
    decode = refresh_decode([DecodeRow(1, n, (1 + i,), seat=s) for i, (n, s) in enumerate(zip(lengths, seats))],
                            len(seats) + padding, 4, 4)
    assert decode.state_slots.tolist() == seats + [NULL_SLOT] * padding


def test_speculative_decoding_is_refused_by_name():
    with pytest.raises(ValueError, match="speculative"):
        ts.LLM(checkpoint(VARIANT), speculative=ts.SpeculativeConfig(num_tokens=2))


@pytest.mark.parametrize("variant, enforce_eager", [(VARIANT, True), (VARIANT, False),
                                                    pytest.param("qwen3_5", False, marks=pytest.mark.skipif(
                                                        "qwen3_5" not in VARIANTS, reason="no Qwen3.5"))])
def test_a_follow_up_turn_resumes_from_the_kept_state_and_matches_transformers(variant, enforce_eager):
    """The first turn computes 28 tokens (23 + 6 - 1) over pages of 4: its state after 28
    is kept; the follow-up copies it and computes only its new tokens."""
    first = make_prompts([23], seed=5)[0]
    llm = ts.LLM(checkpoint(variant), page_size=4, max_num_batched_tokens=16, enforce_eager=enforce_eager)
    params = ts.SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    answer = list(llm.generate([first], params, use_tqdm=False)[0].outputs[0].token_ids)
    follow_up = first + answer + make_prompts([9], seed=6)[0]
    got = llm.generate([follow_up], params, use_tqdm=False)[0]
    assert got.metrics.num_cached_tokens == 28
    assert answer == list(reference(variant, [first], 6, eos=None)[0])
    assert list(got.outputs[0].token_ids) == list(reference(variant, [follow_up], 6, eos=None)[0])


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_the_samples_of_one_prompt_each_compute_its_state(prefix_caching):
    """The pages of a prompt shared by its samples would skip the recurrent layers: each
    sample computes the prompt (greedy: every sample is transformers' answer)."""
    prompt = make_prompts([23], seed=5)[0]
    llm = ts.LLM(checkpoint(VARIANT), page_size=4, max_num_batched_tokens=16, enforce_eager=True,
                 enable_prefix_caching=prefix_caching)
    out = llm.generate([prompt], ts.SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, n=3),
                       use_tqdm=False)[0]
    expected = list(reference(VARIANT, [prompt], 6, eos=None)[0])
    assert [list(c.token_ids) for c in out.outputs] == [expected] * 3


@functools.lru_cache(maxsize=None)
def _kept_and_whole() -> tuple[ts.LLM, ts.LLM]:
    kw = dict(page_size=4, max_num_batched_tokens=16, max_num_seqs=2, enforce_eager=True)
    return ts.LLM(checkpoint(VARIANT), **kw), ts.LLM(checkpoint(VARIANT), enable_prefix_caching=False, **kw)


@settings(max_examples=6, deadline=None, derandomize=True)
@given(first=st.integers(4, 30), answer=st.integers(1, 8), new=st.integers(1, 6))
def test_a_state_resumed_from_the_prefix_cache_equals_the_recomputed_one(first, answer, new):
    """The states a follow-up's seat takes from the kept checkpoint (every linear layer's
    convolution and recurrence) equal those of an engine that computes the same tokens whole."""
    kept, whole = _kept_and_whole()
    prompt = make_prompts([first], seed=first * 37 + answer)[0]
    params = ts.SamplingParams(temperature=0.0, max_tokens=answer, ignore_eos=True)
    tokens = prompt + list(kept.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids)
    pools, restored = kept.model.model.state_pools, []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pools, "copy_slots", _recording_restores(pools, kept.engine.scheduler.max_num_seqs, restored))
        follow_up = kept.generate([tokens + make_prompts([new], seed=first)[0]], params, use_tqdm=False)[0]
    resumed = follow_up.metrics.num_cached_tokens
    assert resumed == (len(tokens) - 1) // 4 * 4
    if not resumed:
        assert not restored
        return
    whole.generate([tokens[:resumed]], ts.SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    recomputed = whole.model.model.state_pools   # seat 1 holds the state after those tokens
    (conv, recurrent), = restored
    torch.testing.assert_close(conv, recomputed.conv[:, 1], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(recurrent, recomputed.recurrent[:, 1], rtol=1e-4, atol=1e-5)


def _recording_restores(pools, max_num_seqs: int, restored: list):
    """``pools.copy_slots`` that first records the states copied into a seat."""
    copy_slots = pools.copy_slots

    def recorded(copies):
        restored.extend((pools.conv[:, source].clone(), pools.recurrent[:, source].clone())
                        for source, destination in copies if destination <= max_num_seqs)
        copy_slots(copies)
    return recorded


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a GPU")
def test_cuda_graphs_and_fla_give_the_cpu_engines_tokens(monkeypatch):
    """float32 on the GPU: prefill through fla's kernels in breaks, decode's one-row forms
    captured in the graphs, a follow-up turn resumed from a kept state. The reference is the CPU engine's, whose tokens equal
    transformers' (tests/test_hf_parity.py; transformers itself cannot serve here: where
    fla is installed its wrappers send CPU tensors to fla's GPU kernels), margins checked."""
    prompts = make_prompts([5, 40, 17], seed=1)
    params = ts.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    kw = dict(dtype=torch.float32, page_size=4, max_num_batched_tokens=32)
    margins = greedy_margins(monkeypatch)
    cpu = ts.LLM(checkpoint(VARIANT), enforce_eager=True, **kw)
    refs = [tuple(o.outputs[0].token_ids) for o in cpu.generate(prompts, params, use_tqdm=False)]
    follow_up = prompts[1] + list(refs[1]) + make_prompts([6], seed=2)[0]   # resumes a kept state
    refs.append(tuple(cpu.generate([follow_up], params, use_tqdm=False)[0].outputs[0].token_ids))
    assert_decisive(margins)
    monkeypatch.undo()   # the recorder reads logits on the host: no capture could hold it
    for eager in (True, False):
        llm = ts.LLM(checkpoint(VARIANT), device="cuda", enforce_eager=eager, **kw)
        got = [tuple(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
        second = llm.generate([follow_up], params, use_tqdm=False)[0]
        # the first turn's 47 computed tokens fill 11 pages of 4; the overlapped loop may also
        # have run its finished row once more (its eighth token fed), filling the twelfth
        assert second.metrics.num_cached_tokens in (44, 48)
        assert got + [tuple(second.outputs[0].token_ids)] == refs, f"enforce_eager={eager}"


@functools.lru_cache(maxsize=None)
def _small_pool_engine() -> ts.LLM:
    """Three sequences at most over a pool of 14 pages of 4: long prompts preempt."""
    return ts.LLM(checkpoint(VARIANT), page_size=4, max_num_seqs=3, num_kv_pages=14, max_num_batched_tokens=16,
                  enforce_eager=True)


@settings(max_examples=8, deadline=None, derandomize=True)
@given(lengths=st.lists(st.integers(1, 24), min_size=1, max_size=5), new=st.integers(1, 6))
def test_live_rows_hold_their_own_slots_and_every_slot_returns(lengths, new):
    """Over chunked prefills, decode steps and preemptions: a live row never reads the null
    slot, two requests never share a slot within a step, and every seat is free at the end."""
    llm = _small_pool_engine()
    steps = []
    backend = type(llm.compiled.decode.backend)
    with pytest.MonkeyPatch.context() as patch:
        for name in ("refresh_decode", "plan_extend"):
            patch.setattr(backend, name, staticmethod(_recording(getattr(backend, name), steps)))
        llm.generate(make_prompts(lengths, seed=sum(lengths)),
                     ts.SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True), use_tqdm=False)
    assert steps
    for slots, requests in steps:
        assert NULL_SLOT not in slots
        assert len(set(zip(requests, slots))) == len(set(requests)) == len(set(slots))
    seats = llm.engine.scheduler.seats
    assert sorted(seats._free) == list(range(1, seats.capacity + 1))


def _recording(build, steps: list):
    def recorded(*args, **kwargs):
        meta = build(*args, **kwargs)
        live = meta.num_live_rows
        steps.append((meta.state_slots[:live].tolist(), meta.row_request[:live].tolist()))
        return meta
    return recorded
