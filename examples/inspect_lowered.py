"""Build a small model, trace it, lower both modes, print every stage and the pass history,
then generate a few tokens."""

import tokenspeed as ts
from tokenspeed.models.random import TINY_LLAMA, random_model


def main() -> None:
    model = random_model({**TINY_LLAMA, "num_hidden_layers": 3}, seed=0)
    traced = ts.trace(model)
    print("# traced\n" + traced.as_text())

    prefill = traced.lower("prefill")
    for stage, segments in prefill.stages.items():
        print(f"\n# prefill stage: {stage}")
        for segment in segments:
            print(segment.as_text())
    print("\n# prefill pass history")
    for name, text in prefill.history:
        print(f"## after {name}: {len(text.splitlines())} lines")

    decode = traced.lower("decode")
    print("\n# decode\n" + decode.as_text())
    print("\n# segment graph:", decode.to_networkx().nodes(data=True))

    llm = ts.LLM(model)
    for out in llm.generate([[1, 2, 3], [4, 5, 6, 7]], ts.SamplingParams(temperature=0.0, max_tokens=6)):
        print(f"{list(out.prompt_token_ids)} -> {list(out.token_ids)} ({out.finish_reason})")


if __name__ == "__main__":
    main()
