"""Startup time (trace, lower, kernel compiles, every capture) in fresh processes.

    python -m benchmarks.startup [--shapes llama-3.2-1b qwen2.5-0.5b] [--models default PATH]

Each run is a new Python process, so nothing is compiled in memory: ``cold`` starts with
an empty Triton cache (a fresh machine), ``warm`` reuses the cache the cold run left (every
later start on that machine); ``serial`` compiles each kernel on first launch
(``compile_workers=0``), ``parallel`` uses the default worker processes. A shape's random
model is built before the clock starts; a model file (``default``: the embedded SmolLM2)
is loaded after it, with ``ts.LLM``'s defaults, as a user starts it (the CUDA context
made first in both).
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
kind, name, workers = sys.argv[1], sys.argv[2], int(sys.argv[3])
options = {} if workers < 0 else {"compile_workers": workers}
if kind == "shape":
    hf = common.hf_model(name)
    model = common.our_model(name, hf)
    del hf
    options |= dict(max_num_seqs=32, max_model_len=4096, max_num_batched_tokens=2048, num_kv_pages=8192)
else:
    model = str(ts.models.default_model_path()) if name == "default" else name
    torch.zeros(1, device="cuda")
torch.cuda.synchronize()
start = time.perf_counter()
llm = ts.LLM(model, device="cuda", **options)
seconds = time.perf_counter() - start
s = llm.compiled.startup
print(json.dumps({"startup_s": seconds, "precompile_s": s.precompile_seconds,
                  "capture_s": s.capture_seconds, "graphs": s.num_graphs,
                  "variants": s.kernel_variants_precompiled}))
"""


def run(kind: str, name: str, workers: int, cache: str) -> dict:
    """One start in a child. Its Python writes bytecode as a user's does (a machine set not to,
    as the H200's is, would compile every module of torch in every start: seconds)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"} | {"TRITON_CACHE_DIR": cache}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", CHILD, kind, name, str(workers)], env=env, cwd=root,
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", nargs="*", default=["llama-3.2-1b"])
    parser.add_argument("--models", nargs="*", default=[],
                        help='model files or directories, started as a user starts them ("default": the embedded '
                             'SmolLM2)')
    parser.add_argument("--json", default="results/startup.json")
    args = parser.parse_args()
    if not args.shapes and not args.models:
        parser.error("nothing to start: name --shapes or --models")
    rows = []
    models = [m if m == "default" else os.path.abspath(m) for m in args.models]   # the child runs in the root
    for kind, name in [("shape", s) for s in args.shapes] + [("model", m) for m in models]:
        for label, workers in (("serial", 0), ("parallel", -1)):
            with tempfile.TemporaryDirectory() as cache:
                for state in ("cold", "warm"):
                    rows.append({"model": name, "compile": label, "cache": state, **run(kind, name, workers, cache)})
            print(common.table(rows[-2:], list(rows[-1])), flush=True)
    common.write_json(args.json, {"commit": common.git_commit(), "device": common.device_name(), "rows": rows})
    print(f"\n# startup, bf16, {common.device_name()}, commit {common.git_commit()}")
    print(common.table(rows, list(rows[0])))


if __name__ == "__main__":
    main()
