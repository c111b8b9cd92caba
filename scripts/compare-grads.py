#!/usr/bin/env python3
"""Compare two gradient files of `hesper grad` (safetensors, PEFT's names): per matrix the
largest difference over the largest magnitude of the reference (the second file), then the
median and the worst over all matrices, and the worst five.

    python3 scripts/compare-grads.py grads-f16.safetensors grads-f32.safetensors
"""
import sys

import numpy as np
from safetensors.numpy import load_file

got, want = load_file(sys.argv[1]), load_file(sys.argv[2])
if set(got) != set(want):
    sys.exit(f"the files hold different matrices: {sorted(set(got) ^ set(want))[:4]}")
errors = []
for name, w in want.items():
    w = w.astype(np.float64)
    scale = np.abs(w).max()
    if scale == 0:
        continue
    errors.append((np.abs(got[name].astype(np.float64) - w).max() / scale, name))
errors.sort()
rel = np.array([e for e, _ in errors])
print(f"{len(errors)} matrices with a non-zero reference (of {len(want)}): "
      f"error over max magnitude, median {np.median(rel):.3g}, worst {rel[-1]:.3g}")
for e, name in errors[-5:]:
    print(f"  {e:.3g}  {name}")
