"""Scratch benchmark (deleted after use)."""
import itertools, sys, time, json
import torch, triton
from tokenspeed.backends.kernels import triton_gemv, triton_attention, reference

T0 = time.time()
dev = "cuda"
torch.manual_seed(0)

def graph_time(fns, reps=20):
    """Mean us per call of running each fn once (cold weights across fns)."""
    for f in fns: f()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns: f()
    g.replay(); torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(reps): g.replay()
    e.record(); torch.cuda.synchronize()
    return s.elapsed_time(e) * 1000 / reps / len(fns)

def weights(n, k):
    copies = max(2, min(16, (400 << 20) // (n * k * 2)))
    return [torch.randn(n, k, device=dev, dtype=torch.bfloat16) for _ in range(copies)]

shapes = [(896, 1152), (896, 4864), (4864, 896), (2048, 8192), (8192, 2048), (2048, 2560), (896, 151936)]
mode = sys.argv[1]
if mode == "gemv":
    res = {}
    for (k, n) in shapes:
        ws = weights(n, k)
        for m in [1, 2, 8, 16]:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            cub = graph_time([lambda w=w: torch.nn.functional.linear(x, w) for w in ws])
            auto = graph_time([lambda w=w: triton_gemv.linear(x, w) for w in ws])
            best = (1e9, None)
            if m in (1, 8) and time.time() - T0 < 200:
                if m == 1:
                    space = itertools.product([8, 16, 32], [128, 256, 512, 1024], [4, 8], [3, 4])
                else:
                    space = itertools.product([16, 32, 64, 128], [128, 256], [4], [3, 4, 5])
                for bn, bk, warps, stages in space:
                    kb = triton.cdiv(k, bk)
                    for sp in sorted({1, 2, 4, 8, 16}):
                        if sp > kb: continue
                        cfg = (bn, bk, sp, warps, stages)
                        try:
                            t = graph_time([lambda w=w: triton_gemv.linear(x, w, config=cfg) for w in ws], reps=5)
                        except Exception as ex:
                            continue
                        if t < best[0]: best = (t, cfg)
            gbs = n * k * 2 / (auto * 1e-6) / 1e9
            print(f"K={k} N={n} M={m}: cublas {cub:.1f}us  triton-auto {auto:.1f}us ({gbs:.0f} GB/s) "
                  f"auto-cfg {triton_gemv.choose_config(m, n, k, 132)}  det={torch.equal(triton_gemv.linear(x, ws[0]), triton_gemv.linear(x, ws[0]))}  best {best[0]:.1f}us {best[1]}", flush=True)
elif mode == "extend":
    ta = triton_attention
    for H, Hkv in [(14, 2), (32, 8)]:
        for lens in [[4096], [512] * 8]:
            P, D = 16, 64
            tot = sum(lens); pages = tot // P + 2 * len(lens)
            kv = torch.randn(1, 2, pages * P, Hkv, D, device=dev, dtype=torch.bfloat16)
            table = (torch.randperm(pages - 1, device=dev) + 1)[: len(lens) * (-(-lens[0] // P))].view(len(lens), -1).int()
            rr = torch.repeat_interleave(torch.arange(len(lens), device=dev), torch.tensor(lens, device=dev))
            pos = torch.cat([torch.arange(n, device=dev) for n in lens])
            q = torch.randn(tot, H, D, device=dev, dtype=torch.bfloat16)
            flops = sum(n * n / 2 for n in lens) * H * D * 4
            res = []
            for bm, bn, w, st in itertools.product([64, 128], [32, 64, 128], [4, 8], [2, 3]):
                if time.time() - T0 > 280: break
                ta.EXTEND_BLOCK_N, ta.EXTEND_WARPS, ta.EXTEND_STAGES = bn, w, st
                plan = ta.extend_tile_plan(rr, bm)
                f = lambda: ta.extend_attention(q, kv, 0, table, rr, pos, 0.125, P, plan=plan)
                try:
                    f(); torch.cuda.synchronize()
                    ms = triton.testing.do_bench(f, warmup=3, rep=15)
                except Exception as ex:
                    print("fail", (bm, bn, w, st), repr(ex)[:150]); continue
                res.append((ms, (bm, bn, w, st)))
            res.sort()
            print(f"extend H={H}/{Hkv} lens={lens[0]}x{len(lens)}: " + "  ".join(f"{ms*1e3:.0f}us {flops/ms/1e9:.0f}TF {c}" for ms, c in res[:4]), flush=True)
elif mode == "attn":
    for H, Hkv in [(14, 2), (32, 8)]:
        for B, ctx in [(1, 4096), (8, 4096), (64, 1024), (64, 4096)]:
            P, D = 16, 64
            pages = B * ctx // P + 1
            kv = torch.randn(1, 2, pages * P, Hkv, D, device=dev, dtype=torch.bfloat16)
            table = (torch.randperm(pages - 1, device=dev) + 1)[: B * ctx // P].view(B, -1).int()
            q = torch.randn(B, H, D, device=dev, dtype=torch.bfloat16)
            rr = torch.arange(B, device=dev); pos = torch.full((B,), ctx - 1, device=dev)
            t = graph_time([lambda: triton_attention.decode_attention(q, kv, 0, table, rr, pos, 0.125, P, max_context=ctx)], reps=50)
            byts = B * ctx * Hkv * D * 2 * 2
            print(f"decode H={H}/{Hkv} B={B} ctx={ctx}: {t:.1f}us {byts/t/1e3:.0f} GB/s splits={triton_attention.choose_num_splits(B, Hkv, ctx, 132)}", flush=True)
        for lens in [[4096], [512] * 8, [2048] * 4]:
            P, D = 16, 64
            tot = sum(lens); pages = tot // P + 1
            kv = torch.randn(1, 2, pages * P, Hkv, D, device=dev, dtype=torch.bfloat16)
            table = (torch.randperm(pages - 1, device=dev) + 1).view(len(lens), -1).int()
            rr = torch.repeat_interleave(torch.arange(len(lens), device=dev), torch.tensor(lens, device=dev))
            pos = torch.cat([torch.arange(n, device=dev) for n in lens])
            q = torch.randn(tot, H, D, device=dev, dtype=torch.bfloat16)
            f = lambda: triton_attention.extend_attention(q, kv, 0, table, rr, pos, 0.125, P)
            f(); torch.cuda.synchronize()
            ms = triton.testing.do_bench(f, warmup=5, rep=50)
            flops = sum(n * n / 2 for n in lens) * H * D * 4
            sd = torch.nn.functional.scaled_dot_product_attention
            qs = q.view(len(lens), lens[0], H, D).transpose(1, 2)
            ks = torch.randn(len(lens), Hkv, lens[0], D, device=dev, dtype=torch.bfloat16)
            ms2 = triton.testing.do_bench(lambda: sd(qs, ks, ks, is_causal=True, enable_gqa=True), warmup=5, rep=50)
            print(f"extend H={H}/{Hkv} lens={lens[0]}x{len(lens)}: {ms*1e3:.0f}us {flops/ms/1e9:.0f} TFLOP/s (sdpa contiguous: {ms2*1e3:.0f}us)", flush=True)
