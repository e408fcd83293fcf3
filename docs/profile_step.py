"""Where a target decode step's time goes (docs/RESULTS.md §0c): torch.profiler over 10 one-token steps of the
embedded target on a 200-token cache, 1 thread (the step `python -m engine costs` times). Run from the
repository root:
    PYTHONPATH=. .venv/bin/python docs/profile_step.py
"""
import torch
from torch.profiler import ProfilerActivity, profile

from engine.costs import step_of
from engine.models import load_pair

torch.set_num_threads(1)
step = step_of(load_pair("embedded", None, device="cpu").target, context=200, w=1, per_row=False, features=None)
for _ in range(5):  # warm
    step()
with profile(activities=[ProfilerActivity.CPU]) as prof:
    for _ in range(10):
        step()
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
