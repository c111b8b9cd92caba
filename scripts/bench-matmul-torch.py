#!/usr/bin/env python3
"""cuBLAS through PyTorch at the GEMM shapes of `bench_matmul` (the same device run): y = x·Wᵀ
(NT) and dx = dy·W (NN) in bf16 and f16, f32 accumulation, median TFLOP/s of
triton.testing.do_bench (CUDA events without triton). Prints markdown rows."""
import torch

try:
    from triton.testing import do_bench
except ImportError:
    def do_bench(fn, warmup=25, rep=100):
        for _ in range(10):
            fn()
        times = []
        for _ in range(50):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(); fn(); b.record(); torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
        times.sort()
        return times[len(times) // 2]

T = 4096
SHAPES = [("square 8192³", (8192, 8192, 8192)), ("q, o", (T, 576, 576)), ("k, v", (T, 192, 576)),
          ("gate, up", (T, 1536, 576)), ("down", (T, 576, 1536)), ("lm-head", (T, 49152, 576))]

print(torch.cuda.get_device_name(), "torch", torch.__version__)
print("| product | M×N×K | bf16 NT / NN TFLOP/s | f16 NT / NN TFLOP/s |")
print("| --- | --- | --- | --- |")
for label, (m, n, k) in SHAPES:
    flops = 2 * m * n * k
    row = []
    for dtype in (torch.bfloat16, torch.float16):
        x = torch.randn(m, k, device="cuda", dtype=dtype)
        dy = torch.randn(m, n, device="cuda", dtype=dtype)
        w = torch.randn(n, k, device="cuda", dtype=dtype)
        nt = do_bench(lambda: x @ w.t())
        nn = do_bench(lambda: dy @ w)
        row.append(f"{flops / nt / 1e9:.0f} / {flops / nn / 1e9:.0f}")
        del x, dy, w
    print(f"| {label} | {m}×{n}×{k} | {row[0]} | {row[1]} |")
