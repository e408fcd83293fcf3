"""A target step alone, beside a draft looping in another thread of this process, and beside the same loop in another
process (docs/RESULTS.md §0r). 1 torch thread each, 200 tokens cached, medians of 55 steps; two rounds, for the 4-bit
self-draft and the distilled draft. Run: PYTHONPATH=. .venv/bin/python docs/beside_the_draft.py"""
import time, torch, statistics, sys, threading, multiprocessing as mp
from engine.models import load_pair

def draft_loop(stop, ready, spec):
    torch.set_num_threads(1)
    pair = load_pair("embedded", spec)
    d = pair.draft
    c = d.new_cache(); d.forward(torch.tensor([[5] * 200]), c)
    ready.set()
    n = 0; s = time.perf_counter()
    while not stop.is_set():
        d.forward(torch.tensor([[123]]), c); c.crop(-1); n += 1
    print("  %s draft ms/step %.2f" % (spec, 1000 * (time.perf_counter() - s) / max(n, 1)), flush=True)

def time_t(lm, cache, reps=60):
    x = torch.tensor([[123]]); ts = []
    for i in range(reps):
        s = time.perf_counter(); lm.forward(x, cache); ts.append(time.perf_counter() - s); cache.crop(-1)
    return 1000 * statistics.median(ts[5:])

def beside(lm, cache, how, spec):
    if how == "thread":
        stop, ready = threading.Event(), threading.Event()
        th = threading.Thread(target=draft_loop, args=(stop, ready, spec))
    else:
        ctx = mp.get_context("spawn"); stop, ready = ctx.Event(), ctx.Event()
        th = ctx.Process(target=draft_loop, args=(stop, ready, spec))
    th.start(); ready.wait(); time.sleep(0.5)
    r = time_t(lm, cache); stop.set(); th.join()
    return r

if __name__ == "__main__":
    torch.set_num_threads(1)
    t = load_pair("embedded", None).target
    c = t.new_cache(); t.forward(torch.tensor([[7] * 200]), c)
    print("static:", t.static)
    for rnd in range(2):
        for spec in ("self", "embedded"):
            print(spec, "alone %.1f" % time_t(t, c), "thread %.1f" % beside(t, c, "thread", spec),
                  "process %.1f" % beside(t, c, "process", spec), flush=True)
