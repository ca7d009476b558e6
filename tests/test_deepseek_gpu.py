"""DeepSeek on the GPU: the latent cache through CUDA graphs (decode and prefill attention
captured with the Triton absorbed kernel) gives transformers' tokens."""

import pytest
import torch

import tokenspeed as ts

from deepseek_models import checkpoint, reference
from hf_models import make_prompts

pytestmark = pytest.mark.gpu
PROMPTS = make_prompts((1, 5, 40, 70, 33), seed=11)


@pytest.mark.parametrize("variant", ["v2_dense", "v3_dense", "v2_moe", "v3_moe"])
def test_graphs_on_the_gpu_give_transformers_tokens(variant):
    llm = ts.LLM(checkpoint(variant), device="cuda", dtype=torch.float32, page_size=16, max_num_seqs=4,
                 max_num_batched_tokens=32, max_model_len=256)
    assert llm.compiled.decode.graphs and llm.compiled.prefill.graphs
    assert not [s for s in llm.compiled.binding.lowered["prefill"].segments if s.name.endswith(".attention")]
    params = ts.SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    got = [o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert got == [tuple(r) for r in reference(variant, PROMPTS, 10)]
