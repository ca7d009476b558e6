"""The throughput benchmark's step timeline, which every change to the engine's speed is
read through (issue 13): it must see every step with prompt work."""

import tokenspeed as ts
from benchmarks.throughput import StepTimeline
from tokenspeed.models.random import TINY_LLAMA, random_model


def test_the_step_timeline_counts_chained_extends_as_prompt_work():
    """Two seats and six prompts of staggered lengths: the later prompts join as others
    finish, through extends chained onto the decode step in flight, which the engine schedules without ``Scheduler.schedule``; each
    of those steps is a prefill step of the timeline, and every step is counted once."""
    llm = ts.LLM(random_model(TINY_LLAMA), max_num_seqs=2)
    timeline, step, steps = StepTimeline(llm.engine), llm.engine.step, []
    llm.engine.step = lambda: (steps.append(1), step())[1]
    prompts = [[(7 * i + j) % 500 + 1 for j in range(10)] for i in range(6)]
    params = [ts.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (5, 9, 13, 7, 11, 6)]
    llm.generate(prompts, params, use_tqdm=False)
    assert timeline.steps["prefill"] >= 3 and timeline.steps["decode"] >= 8
    assert timeline.steps["prefill"] + timeline.steps["decode"] == len(steps)
