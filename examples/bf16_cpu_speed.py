"""How much slower bf16 autocast trains than float32 on this CPU: a small Llama (from its config, no download),
AdamW, batches of 8 x 256 tokens; medians of 5 repeats of 5 steps each, both precisions in one process.

    OMP_NUM_THREADS=1 python examples/bf16_cpu_speed.py
    OMP_NUM_THREADS=1 ONEDNN_MAX_CPU_ISA=AVX2 python examples/bf16_cpu_speed.py   # as a CPU without bf16 instructions

ONEDNN_MAX_CPU_ISA caps the instructions oneDNN (torch's CPU kernels for bf16 matmuls) uses, so one machine shows
both cases. Figures: docs/language-models.md#precision-on-a-cpu.
"""

import statistics
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=1024, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512))
optimizer = torch.optim.AdamW(model.parameters(), 1e-4)
ids = torch.randint(0, 1024, (8, 256))


def step_time(bf16: bool, steps: int = 5) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):  # what --mixed-precision bf16 does on a CPU
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return (time.perf_counter() - start) / steps


step_time(False, 2), step_time(True, 2)  # warm-up
fp32, bf16 = [], []
for _ in range(5):
    fp32.append(step_time(False))
    bf16.append(step_time(True))
fp32_s, bf16_s = statistics.median(fp32), statistics.median(bf16)
print(f"float32 {fp32_s * 1000:.0f} ms/step, bf16 {bf16_s * 1000:.0f} ms/step: bf16 takes {bf16_s / fp32_s:.2f}x the time")
