"""The SpecBranch engine: a target model and a draft, and the decoders that speculate with them.

Packages, by job (imports run downwards only):
  methods/    the decoders (ar, sd, pearl and specbranch, hf-assisted) and the verification rules alone
              (methods/sampling.py), with what places SpecBranch's forks (calibration, H-RAD)
  models/     loading a model spec into an LM, its KV caches, and the static decode paths (lean, static_forward)
  drafts/     the kinds of draft: distilled small LMs, the EAGLE-style draft head, a draft in its own process
  kernels/    the CPU matmuls a step reads its weights through (int4, bfloat16, oneDNN-packed)
  training/   the tools that make drafts and the H-RAD classifier (distill, distill --kind head, train-hrad)
  measure/    the benchmark prompts, the bench, forward costs and the metrics computed from events
At the top: config (the typed settings, the method registry and errors), presets (per-draft defaults), events (the
typed stream every decoder emits), runtime (one worker per model, timed), engine (a loaded pair and `generate`), load
(an Engine from ModelSettings), args (the model flags the app shares) and cli (`python -m engine`, which parses and
hands the rest typed settings).

One arrow runs back up between packages, never between modules: models/loading.py composes the drafts
(drafts.process.RemoteLM among them), and drafts/child.py, the entry of a draft's own process, loads through it.
"""

import os

# An idle OpenMP thread sleeps at once instead of spinning for its next job (libgomp reads this as torch is imported,
# so it is set before anything here imports torch; a value the caller set is kept). On 2 cores the draft's 2-thread
# steps left a thread spinning on the core that the target, the loop or the draft's answer needed: an answer from the
# draft's process waited 2.0 ms to be read, 0.4 ms without the spin, and `ar`, PEARL and SpecBranch ran 6-9 % faster
# (docs/models.md). The draft's process inherits it with the environment.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
