#!/usr/bin/env python3
# The independent reference of tests/smollm2.rs: Hugging Face transformers loads the same GGUF
# (dequantized by the `gguf` package) and computes the per-token cross-entropy of the test's
# token ids in f32 on the CPU. Needs torch, transformers and gguf (pure Python); run on the H200
# machine, 2026-12-01: transformers 5.17.0, torch 2.11.0, gguf 0.19.0.
# Usage: scripts/hf-reference-loss.py models/SmolLM2-135M-Instruct.Q4_1.gguf
import sys, torch, transformers
from transformers import AutoModelForCausalLM
path = sys.argv[1]
import os
model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path), torch_dtype=torch.float32)
model.eval()
ids = [504, 3575, 282, 4649, 314, 7042, 30, 378, 3575, 282, 4521, 314, 11452, 30, 378, 3575, 282, 7158, 314, 7268, 30]
x = torch.tensor([ids])
with torch.no_grad():
    logits = model(x).logits[0].double()
lp = torch.log_softmax(logits, -1)
per = [-(lp[t, ids[t + 1]]).item() for t in range(len(ids) - 1)]
print("transformers", transformers.__version__, "torch", torch.__version__)
print("hf mean loss", sum(per) / len(per))
print("hf per token", [round(p, 5) for p in per])
