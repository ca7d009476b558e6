"""Diagnose where graph and eager generation part: first differing prompt and step."""

import torch

import tokenspeed as ts
from tokenspeed.models.random import TINY_LLAMA, random_model

MID = {**TINY_LLAMA, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
       "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 1024}
for dtype in (torch.float32, torch.bfloat16):
    model = random_model(MID, seed=5).to("cuda", dtype)
    kw = dict(device="cuda", page_size=16, max_num_seqs=10, max_num_batched_tokens=128, max_model_len=512)
    g, e = ts.LLM(model, capture_sizes=(1, 2, 4, 8), **kw), ts.LLM(model, enforce_eager=True, **kw)
    p = ts.SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for n in (1, 3, 8, 10):
        prompts = [[(3 + 11 * i + j) % 500 for j in range(2 + 9 * i)] for i in range(n)]
        a = [o.token_ids for o in g.generate(prompts, p)]
        b = [o.token_ids for o in e.generate(prompts, p)]
        diffs = [(i, next(k for k, (x, y) in enumerate(zip(u, v)) if x != y)) for i, (u, v) in enumerate(zip(a, b)) if u != v]
        print(dtype, n, "equal" if not diffs else f"differ (prompt, first step): {diffs}")
