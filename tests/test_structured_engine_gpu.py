"""Constrained decoding on the GPU: the captured decode graphs replay unchanged, and the
masked draw after them (the Triton bitmask kernel) gives the tokens of eager steps."""

import pytest

import tokenspeed as ts

from test_structured_engine import CHOICE, PROMPT, REGEX, SCHEMA, holds
from text_models import text_model_dir

pytestmark = pytest.mark.gpu


def gpu_llm(**kw):
    return ts.LLM(str(text_model_dir()), device="cuda", page_size=16, max_num_seqs=8, max_model_len=512, **kw)


def workload(seed: int) -> list[ts.SamplingParams]:
    spec = [ts.StructuredOutputs(json=SCHEMA), ts.StructuredOutputs(regex=REGEX),
            ts.StructuredOutputs(choice=CHOICE), None, ts.StructuredOutputs(json=SCHEMA)]
    return [ts.SamplingParams(temperature=0.0 if i == 4 else 1.0, seed=seed + i, max_tokens=96,
                              structured_outputs=s, logit_bias={13: 2.0} if i == 3 else None)
            for i, s in enumerate(spec)]


def test_constrained_decoding_with_cuda_graphs_equals_eager():
    graphs, eager = gpu_llm(capture_sizes=(1, 2, 4, 8)), gpu_llm(enforce_eager=True)
    assert graphs.compiled.decode.graphs and not eager.compiled.decode.graphs
    for seed in (0, 100):
        got = graphs.generate([PROMPT] * 5, workload(seed), use_tqdm=False)
        want = eager.generate([PROMPT] * 5, workload(seed), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
        assert all(holds(p, o.outputs[0].text, o.outputs[0].finish_reason) for p, o in zip(workload(seed), got))
