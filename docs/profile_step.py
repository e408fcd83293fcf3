"""Where a target decode step's time goes (docs/RESULTS.md §0c): torch.profiler over 10 one-token steps of the
embedded target on a 200-token cache, 1 thread. Run from the repository root:
    PYTHONPATH=. .venv/bin/python docs/profile_step.py
"""
import torch
from torch.profiler import ProfilerActivity, profile

from engine import cache as kv
from engine.models import load_pair

torch.set_num_threads(1)
target = load_pair("embedded", None, device="cpu").target
cache = target.new_cache()
target.forward(torch.randint(0, 1000, (1, 200)), cache)
x = torch.randint(0, 1000, (1, 1))


def step():
    target.forward(x, cache)
    kv.rollback(cache, 200)


for _ in range(5):  # warm
    step()
with profile(activities=[ProfilerActivity.CPU]) as prof:
    for _ in range(10):
        step()
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
