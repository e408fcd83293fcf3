"""python docs/results/tools/draft_memory.py > docs/results/json/draft-memory.json (last line): RSS of each embedded
draft's process, and of the app's own process, as app.py loads them (draft in a process,
lean forward: what the app runs, minus the background compile)."""

import importlib.util
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, ROOT)
os.chdir(ROOT)
import psutil
import torch

torch.set_num_threads(1)
spec = importlib.util.spec_from_file_location("app_main_script", os.path.join(ROOT, "app.py"))
appmod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(appmod)
from engine.config import ModelSettings  # noqa: E402

args = ModelSettings(target="embedded", draft_forward="lean", draft_worker="process")
me = psutil.Process()
mb = lambda b: round(b / 2**20)
out = {"before_mb": mb(me.memory_info().rss)}
cache = appmod.EngineCache(lambda d, t: appmod.load_engine(args, d, t), "self", cap=5)
for draft in appmod.EMBEDDED_CHOICES:
    t = time.time()
    e = cache.get(draft)
    child = psutil.Process(e.pair.draft._process.pid) if hasattr(e.pair.draft, "_process") else None
    out[draft] = {
        "child_rss_mb": mb(child.memory_info().rss) if child else None,
        "child_uss_mb": mb(child.memory_full_info().uss) if child else None,
        "app_rss_mb": mb(me.memory_info().rss),
        "load_s": round(time.time() - t, 1),
        "worker": e.pair.draft_worker,
    }
    print(draft, out[draft], file=sys.stderr, flush=True)
print(json.dumps(out))
cache.close()
