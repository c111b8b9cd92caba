#!/usr/bin/env python3
"""PyTorch + PEFT's LoRA step at the SmolLM2-135M shape (random weights), the work
`bench_step` times: LoRA q, v at r = 8, S = 512, AdamW, the mean token loss. Frozen weights in
bf16, LoRA's in f32 (PEFT's default), eager and `torch.compile`d; the median of 20 steps after
a warm-up (CUDA events around each step). Prints one table row a batch and mode.

Usage: scripts/bench-step-torch.py [BATCH ...]   (default 8 32; needs torch, transformers, peft)
"""
import statistics
import sys

import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

SEQ = 512


def model():
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                      num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                      max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=100000.0,
                      tie_word_embeddings=True, attn_implementation="sdpa")
    torch.manual_seed(0)
    base = LlamaForCausalLM(cfg).to(device="cuda", dtype=torch.bfloat16)
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    return get_peft_model(base, lora)


def bench(batch, compiled):
    m = model()
    params = [p for p in m.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    ids = torch.randint(0, 49152, (batch, SEQ), device="cuda")

    def step():
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    run = torch.compile(step) if compiled else step
    for _ in range(5):
        run()
    torch.cuda.synchronize()
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    ms = statistics.median(times)
    mode = "compiled" if compiled else "eager"
    print(f"| {batch} × {SEQ} | {mode} | {ms:.1f} ({min(times):.1f}–{max(times):.1f}) | "
          f"{batch * SEQ / ms * 1e3:,.0f} |", flush=True)


if __name__ == "__main__":
    print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    print("| B × S | mode | ms/step (min–max) | tokens/s |\n|---|---|---|---|", flush=True)
    for b in [int(a) for a in sys.argv[1:]] or [8, 32]:
        for compiled in (False, True):
            bench(b, compiled)
