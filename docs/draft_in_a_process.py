"""Feasibility (docs/RESULTS.md §0r): the target steps in a thread of this process while the draft steps in another
process, asked over a pipe for each step and answering with its logits row (49k floats), as an engine would; against
both in threads. Run: PYTHONPATH=. .venv/bin/python docs/draft_in_a_process.py self|embedded"""
import time, torch, statistics, threading, multiprocessing as mp, sys
from engine.models import load_pair

def child(conn, spec):
    torch.set_num_threads(1)
    d = load_pair("embedded", spec).draft
    c = d.new_cache(); d.forward(torch.tensor([[5] * 200]), c)
    conn.send("ready")
    while True:
        msg = conn.recv()
        if msg is None:
            break
        out = d.forward(torch.tensor([[msg]]), c)[0, -1]
        c.crop(-1)
        conn.send_bytes(out.numpy().tobytes())

def target_loop(t, cache, stop, times):
    x = torch.tensor([[123]])
    while not stop.is_set():
        s = time.perf_counter(); t.forward(x, cache); times.append(time.perf_counter() - s); cache.crop(-1)

if __name__ == "__main__":
    torch.set_num_threads(1)
    spec = sys.argv[1] if len(sys.argv) > 1 else "self"
    pair = load_pair("embedded", spec); t, d = pair.target, pair.draft
    tc = t.new_cache(); t.forward(torch.tensor([[7] * 200]), tc)
    dc = d.new_cache(); d.forward(torch.tensor([[5] * 200]), dc)
    ctx = mp.get_context("spawn"); a, b = ctx.Pipe(); p = ctx.Process(target=child, args=(b, spec)); p.start(); a.recv()
    for rnd in range(2):
        for how in ("thread", "process"):
            stop, times, dts = threading.Event(), [], []
            th = threading.Thread(target=target_loop, args=(t, tc, stop, times)); th.start()
            end = time.perf_counter() + 4
            while time.perf_counter() < end:
                s = time.perf_counter()
                if how == "thread":
                    out = d.forward(torch.tensor([[123]]), dc)[0, -1]; dc.crop(-1)
                else:
                    a.send(123); out = torch.frombuffer(bytearray(a.recv_bytes()), dtype=torch.float32)
                dts.append(time.perf_counter() - s)
            stop.set(); th.join()
            print(spec, how, "target step %.1f ms" % (1000 * statistics.median(times[2:])),
                  "draft step (round trip) %.1f ms" % (1000 * statistics.median(dts[2:])), flush=True)
    a.send(None); p.join()
