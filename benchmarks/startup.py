"""Startup time (trace, lower, kernel compiles, every capture) in fresh processes.

    python -m benchmarks.startup [--shapes llama-3.2-1b qwen2.5-0.5b]

Each run is a new Python process, so nothing is compiled in memory: ``cold`` starts with
an empty Triton cache (a fresh machine), ``warm`` reuses the cache the cold run left (every
later start on that machine); ``serial`` compiles each kernel on first launch
(``compile_workers=0``), ``parallel`` uses the default worker processes.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

from benchmarks import common

CHILD = """
import json, sys, time, torch
import tokenspeed as ts
from benchmarks import common
shape, workers = sys.argv[1], int(sys.argv[2])
hf = common.hf_model(shape)
ours = common.our_model(shape, hf)
del hf
torch.cuda.synchronize()
start = time.perf_counter()
llm = ts.LLM(ours, device="cuda", max_num_seqs=32, max_model_len=4096, max_num_batched_tokens=2048,
             num_kv_pages=8192, **({} if workers < 0 else {"compile_workers": workers}))
seconds = time.perf_counter() - start
s = llm.compiled.startup
print(json.dumps({"startup_s": seconds, "precompile_s": s.precompile_seconds,
                  "capture_s": s.capture_seconds, "graphs": s.num_graphs,
                  "variants": s.kernel_variants_precompiled}))
"""


def run(shape: str, workers: int, cache: str) -> dict:
    env = {**os.environ, "TRITON_CACHE_DIR": cache}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", CHILD, shape, str(workers)], env=env, cwd=root,
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", nargs="+", default=["llama-3.2-1b"])
    parser.add_argument("--json", default="results/startup.json")
    args = parser.parse_args()
    rows = []
    for shape in args.shapes:
        for label, workers in (("serial", 0), ("parallel", -1)):
            with tempfile.TemporaryDirectory() as cache:
                rows.append({"shape": shape, "compile": label, "cache": "cold", **run(shape, workers, cache)})
                rows.append({"shape": shape, "compile": label, "cache": "warm", **run(shape, workers, cache)})
            print(common.table(rows[-2:], list(rows[-1])), flush=True)
    common.write_json(args.json, {"commit": common.git_commit(), "device": common.device_name(), "rows": rows})
    print(f"\n# startup, bf16, {common.device_name()}, commit {common.git_commit()}")
    print(common.table(rows, list(rows[0])))


if __name__ == "__main__":
    main()
