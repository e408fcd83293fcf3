"""A/B of the engine's one-thread host loop (docs/RESULTS.md §0n).

Engine._generate sets the calling thread's torch thread count to 1: the host work between the forwards (sampling,
verification) runs there. This measures what that call does for a caller that never set its thread count, e.g. a
script that loads a pair and calls Engine.run: its thread keeps the machine's default (os.cpu_count() threads).
Arm "before" turns the engine's call into a no-op, arm "after" keeps it; before every run the caller's thread is put
back to the default. Both arms run `ar`, `sd` and `pearl` with the 4-bit self-draft on 2 benchmark prompts
(MT-Bench, GSM8K) × 48 tokens, alternated 3 times, and print the running mean tokens/s and draft step ms.

(The app runs each generation on a fresh thread, which torch starts at the last count any thread set, so from the
second generation on the workers' 1; only the app's first generation is such a caller.)

  PYTHONPATH=. python docs/host_thread_ab.py
"""
import os
import types

import torch

import engine.engine as engine_module
from engine.config import GenerationConfig
from engine.datasets import benchmark_prompts
from engine.models import load_pair

DEFAULT = os.cpu_count() or 1
ARMS = {"after": engine_module.torch, "before": types.SimpleNamespace(set_num_threads=lambda n: None)}
engine = engine_module.Engine(load_pair("embedded", "self"))
prompts = [p for d in ("mt_bench", "gsm8k") for p in benchmark_prompts(d, 1)]
speeds: dict[str, list[float]] = {}
draft_ms: dict[str, list[float]] = {}
for r in range(3):
    for arm, torch_like in ARMS.items():
        engine_module.torch = torch_like
        for method in ("ar", "sd", "pearl"):
            for p in prompts:
                torch.set_num_threads(DEFAULT)  # a caller that never set it
                cfg = GenerationConfig(method=method, max_new_tokens=48, gamma=6, head_start=0.02, epsilon=0.1)
                m = engine.run(engine.encode(p.text, p.chat), cfg).metrics
                speeds.setdefault(f"{arm}/{method}", []).append(m["tokens_per_s"])
                if m["draft_forward_ms"]:
                    draft_ms.setdefault(f"{arm}/{method}", []).append(m["draft_forward_ms"])
    print(r, "tok/s", {k: round(sum(v) / len(v), 1) for k, v in speeds.items()},
          "draft ms", {k: round(sum(v) / len(v), 1) for k, v in draft_ms.items()}, flush=True)
engine_module.torch = ARMS["after"]
