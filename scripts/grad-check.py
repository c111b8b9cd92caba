#!/usr/bin/env python3
"""Check the LoRA gradients `hesper grad` wrote against PyTorch autograd in f64.

transformers loads the base model from the GGUF (dequantized by the `gguf` package, Llama's Q/K
rows un-permuted by its loader, as hesper's loader does); PEFT wraps it with the adapter
(`PeftModel.from_pretrained(..., is_trainable=True)`); the whole model is cast to f64. The loss
is Hugging Face's causal-LM loss over the data file's `input_ids` rows (the mean over every
predicted token of the batch, rows of one length so that nothing is padded) — what
`hesper grad` computes on the same rows. Each adapter matrix's gradient is compared with the
file's (keys as PEFT saves them, `lora_A.weight` / `lora_B.weight`): the largest
|hesper - torch| over the largest |torch| of each tensor, and over all of them.

Usage: scripts/grad-check.py MODEL.gguf ADAPTER_DIR DATA.jsonl GRADS.safetensors [TOLERANCE]
Exits non-zero when a tensor is missing or its error passes TOLERANCE (default 1e-4).
"""
import json
import os
import sys

import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

if len(sys.argv) not in (5, 6):
    sys.exit(__doc__)
gguf_path, adapter_dir, data_path, grads_path = sys.argv[1:5]
tolerance = float(sys.argv[5]) if len(sys.argv) == 6 else 1e-4

rows = [json.loads(line)["input_ids"] for line in open(data_path) if line.strip()]
assert len({len(r) for r in rows}) == 1, "rows of one length: nothing padded"
gguf_path = os.path.abspath(gguf_path)
base = AutoModelForCausalLM.from_pretrained(
    os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path), torch_dtype=torch.float32
)
model = PeftModel.from_pretrained(base, adapter_dir, is_trainable=True).double()
ids = torch.tensor(rows)
loss = model(input_ids=ids, labels=ids).loss
loss.backward()

ours = load_file(grads_path)
worst, checked, missing = 0.0, 0, []
for name, p in model.named_parameters():
    if "lora_" not in name:
        continue
    key = name.replace(".default.", ".")
    if key not in ours:
        missing.append(key)
        continue
    want = p.grad.double()
    got = ours[key].double()
    assert got.shape == want.shape, f"{key}: shape {tuple(got.shape)}, torch's {tuple(want.shape)}"
    scale = want.abs().max().item()
    err = (got - want).abs().max().item() / max(scale, 1e-30)
    worst = max(worst, err)
    checked += 1
    if err > tolerance:
        print(f"{key}: relative error {err:.3g} (largest |grad| {scale:.3g})")
extra = sorted(set(ours) - {n.replace(".default.", ".") for n, _ in model.named_parameters()})
print(f"loss (torch, f64) {loss.item():.7f}")
print(f"{checked} gradients compared; worst relative error {worst:.3g} (tolerance {tolerance:g})")
assert not missing, f"gradients the file lacks: {missing[:4]} ({len(missing)})"
assert not extra, f"gradients of the file torch has no parameter for: {extra[:4]}"
assert checked > 0 and worst <= tolerance, "gradients differ"
print("gradients match")
