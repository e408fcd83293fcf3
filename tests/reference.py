"""References independent of the engine. Greedy: transformers' own generate() on a model loaded apart
(transformers_model), which no engine LM ever wrapped, so none of the engine's kernels run in it
(engine.models.loading.LM routes the Linear layers of the model it wraps through engine/kernels/lm_head.py;
`untouched` asserts that none was). Sampled: the target's exact distribution computed from such a model's forward and
a float64 softmax with temperature, top-k and top-p written here, never the engine's sampling.logits_to_probs (a bug
there would otherwise hide in both)."""

from __future__ import annotations

import itertools

import numpy as np
import torch
from scipy.stats import chisquare

PROMPT = [2, 3, 4]  # a prompt for conftest's tiny models


def untouched(model: torch.nn.Module) -> torch.nn.Module:
    """`model`, asserted to run transformers' own code in every Linear layer: each one's forward is
    torch.nn.Linear.forward, not an instance attribute the engine routed through its kernels (lm_head.fast_linears)."""
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    routed = [name for name, m in linears if "forward" in vars(m) or type(m).forward is not torch.nn.Linear.forward]
    assert linears and not routed, f"the reference runs the engine's kernels in {routed[:3]}"
    return model


def transformers_model(source) -> torch.nn.Module:
    """transformers' own float32 model from the directory `source`, loaded here, apart from any the engine loaded:
    no engine LM ever wraps it (asserted again at each use, `greedy_generate`)."""
    from transformers import AutoModelForCausalLM

    return untouched(AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32).eval())


def greedy_generate(model: torch.nn.Module, prompt: list[int], new: int) -> list[int]:
    """The `new` tokens transformers' greedy generate() gives after `prompt` on a model that runs its own code."""
    with torch.inference_mode():
        out = untouched(model).generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False)
    return out[0, len(prompt) :].tolist()


def processed(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """Rows of next-token probabilities, float64, after temperature, top-k and top-p (written here, not
    engine.methods.sampling's): top-k keeps every token whose logit is at least the k-th largest; top-p keeps, in
    order of
    probability, each token while the tokens ranked above it cover less than top_p (the first always stays)."""
    z = np.asarray(logits, dtype=np.float64) / temperature
    out = np.empty_like(z)
    for r, row in enumerate(z):
        keep = np.ones(row.shape, dtype=bool)
        if 0 < top_k < row.size:
            keep &= row >= np.sort(row)[::-1][top_k - 1]
        w = np.where(keep, np.exp(row - row[keep].max()), 0.0)
        w /= w.sum()
        if top_p < 1.0:
            order = np.argsort(-w, kind="stable")
            above = np.cumsum(w[order]) - w[order]
            drop = np.zeros(row.shape, dtype=bool)
            drop[order[above >= top_p]] = True
            w = np.where(drop, 0.0, w)
            w /= w.sum()
        out[r] = w
    return out


def exact_joint(model, prompt, length, cfg, vocab):
    """P(first `length` tokens) under `model` with cfg's temperature/top-k/top-p, by enumeration: transformers' own
    forward of the model, and `processed`."""
    seqs = list(itertools.product(range(vocab), repeat=length))
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([prompt + list(s) for s in seqs])).logits
    out = {}
    for seq, rows in zip(seqs, logits[:, len(prompt) - 1 : -1].double().numpy()):
        p = processed(rows, cfg.temperature, cfg.top_k, cfg.top_p)
        out[seq] = float(np.prod([p[i, t] for i, t in enumerate(seq)]))
    return out


def chi_square(counts: dict, expected: dict, n: int) -> float:
    """Pearson's chi-square p-value of `counts` against `expected` probabilities, cells expected below 5 pooled."""
    keys = sorted(expected)
    obs = [counts.get(k, 0) for k in keys]
    exp = [expected[k] * n for k in keys]
    big = [(o, e) for o, e in zip(obs, exp) if e >= 5]
    small_o, small_e = sum(o for o, e in zip(obs, exp) if e < 5), sum(e for e in exp if e < 5)
    o = [b[0] for b in big] + ([small_o] if small_e > 0 else [])
    e = [b[1] for b in big] + ([small_e] if small_e > 0 else [])
    e = [x * sum(o) / sum(e) for x in e]
    return chisquare(o, e).pvalue
