"""Regenerate the tables of docs/results/README.md (and the README's headline) from docs/results/json/.

    python docs/results/make_tables.py           rewrite every table between its markers
    python docs/results/make_tables.py --check   exit 1 if a table differs from what the JSON gives

A table sits between `<!-- table:NAME -->` and `<!-- /table -->`; everything outside the markers is left as is.
Standard library only. The JSON files are `python -m engine bench --json` reports (one run), `python -m engine
summarize` reports (mean ± sample sd over seeds), and `python -m engine costs` reports (forward costs, and the model
of a bench).
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
JSON = HERE / "json"
FILES = [HERE / "README.md", HERE.parent.parent / "README.md"]
MARKER = re.compile(r"(<!-- table:([a-z-]+) -->\n)(.*?)(<!-- /table -->)", re.S)


def load(name: str) -> dict:
    return json.loads((JSON / f"{name}.json").read_text())


def link(names: list[str], base: str = "json/") -> str:
    """Links to JSON files; one run per seed (NAME-s0, NAME-s1, ...) as NAME-s[0], [1], ..."""
    stem = names[0][:-1]
    if len(names) > 1 and stem.endswith("-s") and all(n[:-1] == stem and n[-1].isdigit() for n in names):
        return stem + ", ".join(f"[{n[-1]}]({base}{n}.json)" for n in names) + " (.json)"
    return ", ".join(f"[{n}.json]({base}{n}.json)" for n in names)


class Figures:
    """Per-method figures of one source: a summary, one bench run, or several bench runs (one per seed) pooled
    here as `engine summarize` does: mean and sample sd of each run's pooled figures."""

    def __init__(self, names: list[str], dataset: str = "all"):
        self.names = names
        runs = [load(n) for n in names]
        self.stats: dict[str, dict[str, tuple[float, float | None]]] = {}
        if len(runs) == 1 and "methods" in runs[0]:
            for method, metrics in runs[0]["methods"].items():
                self.stats[method] = {k: (v["mean"], v["sd"] if v["n"] > 1 else None) for k, v in metrics.items() if v}
            self.n = len(runs[0]["runs"])
            return
        self.n = len(runs)
        for method in runs[0]["results"]:
            rows = [run["results"][method][dataset] for run in runs]
            out = {}
            for key, value in rows[0].items():
                if isinstance(value, (int, float)) and all(isinstance(r.get(key), (int, float)) for r in rows):
                    values = [r[key] for r in rows]
                    out[key] = (statistics.mean(values), statistics.stdev(values) if len(values) > 1 else None)
            self.stats[method] = out

    def get(self, method: str, key: str):
        return self.stats.get(method, {}).get(key)

    def fmt(self, method: str, key: str, digits: int = 2, sd: bool = True) -> str:
        value = self.get(method, key)
        if value is None:
            return "–"
        mean, spread = value
        text = f"{mean:.{digits}f}"
        return f"{text} ± {spread:.{digits}f}" if sd and spread is not None else text

    def shipped(self) -> str:
        """SpecBranch as it ships (confidence only): `specbranch`, except where the bench's `specbranch` row ran
        H-RAD with weights for its draft (the distilled draft's ablation): there `specbranch-no-hrad`."""
        return "specbranch-no-hrad" if self.names[0] in HRAD_RAN else "specbranch"


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- the sources of each table
SELF_T0, SELF_T1 = "ablation-0z-t0", "ablation-0z-t1"
HEADLINE_T0, HEADLINE_T1 = "headline-t0", "headline-t1"  # `make bench`: the default command, at T=0 and T=1
SEEDS = {t: [f"ablation-0z-t{t}-s{s}" for s in range(3)] for t in (0, 1)}
WEAK_ON = [f"holdbranches-recheck-on-s{s}" for s in range(3)]
WEAK_OFF = [f"holdbranches-recheck-off-s{s}" for s in range(3)]

# benches whose `specbranch` row ran H-RAD with weights made for its draft; elsewhere `--hrad` found none and
# `specbranch` ran the shipped code (confidence only)
HRAD_RAN = {"ablation-0e-t0", "ablation-0e-t1"}

AVX2_RUN = "2026-11-27, before the answer board, one run, AVX2 CPU"  # the regime runs' machine (the README's section)
AVX2_BEFORE = "2026-11-28, before the numpy row reads, one run, AVX2 CPU"
AVX2_NOW = "2026-11-28, before the answer board, one run, AVX2 CPU"
AVX512_BEFORE = "2026-11-28, before the draft was asked from the loop, one run, AVX-512 CPU"  # "The distilled draft
# in 4 bits"
AVX512_NOW = "2026-11-28, draft asked from the loop, one run, AVX-512 CPU"  # the section "Host time: ..."
AVX512_SOCKET = "2026-12-02, answers through the socket, one run, AVX-512 CPU"  # the section "Host time: what a step
# through the draft's process costs"
AVX512_BOARD = "2026-12-02, before the AVX-512 panel kernel, one run, AVX-512 CPU"

# (draft, T, sources, settings, when measured)
SPEED = [
    ("`self`, no flag (the defaults)", 0, [HEADLINE_T0], "A", "2026-12-04, current engine, one run"),
    ("`self`, no flag (the defaults)", 1, [HEADLINE_T1], "A", "2026-12-04, current engine, one run"),
    ("`self` (4-bit, compiled)", 0, [SELF_T0], "A", "2026-11-26, before the answer board"),
    ("`self` (4-bit, compiled)", 1, [SELF_T1], "A", "2026-11-26, before the answer board"),
    (
        "`self`, no flag, the library's kernels on the AMD EPYC, 6 prompts",
        0,
        ["amd-library-self-t0"],
        "A",
        "2026-12-04, the engine of 04d0766, one run, AMD AVX-512 CPU",
    ),
    (
        "`self`, no flag, the AVX-512 panel kernel on the AMD EPYC, 6 prompts",
        0,
        ["amd-panel-self-t0"],
        "A",
        "2026-12-04, current engine, one run, AMD AVX-512 CPU",
    ),
    ("`self-skip:4,5`", 0, ["skip4-5-t0"], "B, hold 0.5", "2026-11-24, older engine"),
    ("`self-skip:4,5`", 1, ["skip4-5-t1"], "B, hold 0.5", "2026-11-24, older engine"),
    ("`self-skip:3,4,5,25`", 0, ["skip3-4-5-25-t0"], "B, hold 0.5", "2026-11-24, older engine"),
    ("`embedded`, its preset", 0, ["regime-embedded-t0"], "B, hold 0.5", AVX2_RUN),
    ("`embedded`, its preset", 1, ["regime-embedded-t1"], "B, hold 0.5", AVX2_RUN),
    (
        "`embedded`, `--tree-tokens 3`",
        0,
        ["regime-embedded-t0-tree3"],
        "B, hold 0.5, tree tokens 3",
        "2026-11-27, before the answer board, one run, AVX2 CPU, 9 prompts",
    ),
    ("`embedded`, its preset, panel kernel", 0, ["panel-embedded-t0"], "B, hold 0.5", AVX2_RUN),
    ("`embedded`, its preset, panel kernel", 1, ["panel-embedded-t1"], "B, hold 0.5", AVX2_RUN),
    (
        "`embedded`, its preset, panel kernel, `--draft-matmul int4`",
        0,
        ["panel-embedded-int4-t0"],
        "B, hold 0.5",
        AVX2_RUN,
    ),
    ("`embedded`, its preset, idle OpenMP threads asleep", 0, ["passive-embedded-t0"], "B, hold 0.5", AVX2_BEFORE),
    ("`embedded`, its preset, idle OpenMP threads asleep", 1, ["passive-embedded-t1"], "B, hold 0.5", AVX2_BEFORE),
    ("`embedded`, its preset, rows read through numpy", 0, ["vocab-embedded-t0"], "B, hold 0.5", AVX2_NOW),
    ("`embedded`, its preset, rows read through numpy", 1, ["vocab-embedded-t1"], "B, hold 0.5", AVX2_NOW),
    ("`embedded` in 4 bits, its preset (no flag)", 0, ["int4-embedded-t0"], "B, hold 0.25", AVX512_BEFORE),
    ("`embedded` in 4 bits, its preset (no flag)", 1, ["int4-embedded-t1"], "B, hold 0.25", AVX512_BEFORE),
    ("`embedded`, matmuls in float32, hold 0.5", 0, ["matmul-embedded-float32-t0"], "B, hold 0.5", AVX512_BEFORE),
    ("`embedded`, matmuls in bfloat16, hold 0.5", 0, ["matmul-embedded-bfloat16-t0"], "B, hold 0.5", AVX512_BEFORE),
    ("`embedded`, matmuls in int4, hold 0.5", 0, ["matmul-embedded-int4-t0"], "B, hold 0.5", AVX512_BEFORE),
    ("`embedded` in 4 bits, its preset, draft asked from the loop", 0, ["host-loop-t0"], "B, hold 0.25", AVX512_NOW),
    ("`embedded` in 4 bits, its preset, a slower spell", 0, ["host-t0"], "B, hold 0.25", AVX512_NOW),
    ("`embedded` in 4 bits, its preset, a slower spell", 1, ["host-current-t1"], "B, hold 0.25", AVX512_NOW),
    (
        "`embedded` in 4 bits, its preset, answers through the socket",
        0,
        ["socket-embedded-t0"],
        "B, hold 0.25",
        AVX512_SOCKET,
    ),
    (
        "`embedded` in 4 bits, its preset, answers through the socket",
        1,
        ["socket-embedded-t1"],
        "B, hold 0.25",
        AVX512_SOCKET,
    ),
    ("`embedded` in 4 bits, its preset, answers on the board", 0, ["board-embedded-t0"], "B, hold 0.25", AVX512_BOARD),
    ("`embedded` in 4 bits, its preset, answers on the board", 1, ["board-embedded-t1"], "B, hold 0.25", AVX512_BOARD),
    (
        "`embedded` in 4 bits, its preset, answers on the board, a second run",
        0,
        ["board-embedded-t0-run2"],
        "B, hold 0.25",
        AVX512_BOARD,
    ),
    (
        "`embedded` in 4 bits, its preset, `--solo-threads 1`",
        0,
        ["solo-split-1-t0"],
        "B, hold 0.25, solo threads 1",
        AVX512_BOARD,
    ),
    (
        "`embedded` in 4 bits, its preset, a slow spell",
        0,
        ["dec03-embedded-t0"],
        "B, hold 0.25",
        "2026-12-03, before the AVX-512 panel kernel, one run, AVX-512 CPU",
    ),
    (
        "`embedded` in 4 bits, its preset, a quiet spell",
        0,
        ["dec04-embedded-t0"],
        "B, hold 0.25",
        "2026-12-04, before the AVX-512 panel kernel, one run, AVX-512 CPU",
    ),
    (
        "`embedded` in 4 bits, its preset, a quiet spell",
        1,
        ["dec04-embedded-t1"],
        "B, hold 0.25",
        "2026-12-04, before the AVX-512 panel kernel, one run, AVX-512 CPU",
    ),
    (
        "`embedded` in 4 bits, its preset, the AVX-512 panel kernel",
        0,
        ["panel-xeon-embedded-t0"],
        "B, hold 0.25",
        "2026-12-04, before grouped attention, one run, AVX-512 CPU",
    ),
    (
        "`embedded` in 4 bits, its preset, the AVX-512 panel kernel",
        1,
        ["panel-xeon-embedded-t1"],
        "B, hold 0.25",
        "2026-12-04, before grouped attention, one run, AVX-512 CPU",
    ),
    (
        "`embedded` in 4 bits, its preset, panel kernel and grouped attention",
        0,
        ["grouped-xeon-embedded-t0"],
        "B, hold 0.25",
        "2026-12-04, current engine, one run, AVX-512 CPU",
    ),
    (
        "`embedded` in 4 bits, its preset, panel kernel and grouped attention",
        1,
        ["grouped-xeon-embedded-t1"],
        "B, hold 0.25",
        "2026-12-04, current engine, one run, AVX-512 CPU",
    ),
    (
        "`embedded` in 4 bits, its preset, the library's kernels on the AMD EPYC",
        0,
        ["amd-library-embedded-t0"],
        "B, hold 0.25",
        "2026-12-04, the engine of 04d0766, one run, AMD AVX-512 CPU",
    ),
    (
        "`embedded` in 4 bits, its preset, the AVX-512 panel kernel on the AMD EPYC",
        0,
        ["amd-panel-embedded-t0"],
        "B, hold 0.25",
        "2026-12-04, current engine, one run, AMD AVX-512 CPU",
    ),
    (
        "`embedded` in 4 bits, its preset, the AVX-512 panel kernel on the AMD EPYC",
        1,
        ["amd-panel-embedded-t1"],
        "B, hold 0.25",
        "2026-12-04, current engine, one run, AMD AVX-512 CPU",
    ),
    ("`embedded`", 0, ["ablation-0e-t0"], "B", "2026-11-23, older engine"),
    ("`embedded`", 1, ["ablation-0e-t1"], "B", "2026-11-23, older engine"),
    ("`embedded-head`", 0, ["bench-cpu-head-t0"], "C", "2026-11-22, older engine, one run"),
    ("`embedded-head`", 1, ["bench-cpu-head-t1"], "C", "2026-11-22, older engine, one run"),
    ("`embedded-weak`, foreign prompts", 0, WEAK_ON, "B, hold 0.5, hold branches", "2026-11-24, draft in its process"),
]


def speed() -> str:
    rows = []
    for draft, t, names, settings, when in SPEED:
        f = Figures(names)
        sb = f.shipped()
        rows.append(
            [
                draft,
                str(t),
                f.fmt("ar", "tokens_per_s", 1, sd=False),
                f.fmt("sd", "speedup_vs_ar"),
                f.fmt("pearl", "speedup_vs_ar"),
                f"**{f.fmt(sb, 'speedup_vs_ar')}**",
                f.fmt("hf-assisted", "speedup_vs_ar"),
                f.fmt("pearl", "acceptance_rate", 3, sd=False),
                str(f.n),
                settings,
                when,
                link(names),
            ]
        )
    return table(
        [
            "draft",
            "T",
            "`ar` tok/s",
            "sd",
            "pearl",
            "specbranch",
            "hf-assisted",
            "α (pearl)",
            "runs",
            "settings",
            "measured",
            "JSON",
        ],
        rows,
    )


# (draft, what it is, α source: (names, method, note), costs JSON or None, speed source at T=0, pick it when)
DRAFTS = [
    (
        "`self`",
        "the target read in 4 bits",
        (["draft-self-int4-t0-n10"], "sd", "SD, 30 prompts"),
        "compiled-costs-lean-compiled",
        SELF_T0,
        "speed: the fastest on a CPU, and the default there; little to reject or branch",
    ),
    (
        "`self-skip:3,4,5,25`",
        "the target without 4 of its layers, 4-bit",
        (["skip3-4-5-25-t0"], "pearl", "PEARL, 6 prompts"),
        "branchkv-costs-B-self-skip",
        "skip3-4-5-25-t0",
        "watching forks rescue (a quarter of them do) at about `ar`'s speed",
    ),
    (
        "`self-skip:4,5`",
        "the target without 2 of its layers, 4-bit",
        (["skip4-5-t0"], "pearl", "PEARL, 6 prompts"),
        None,
        "skip4-5-t0",
        "a mid-α pair a little faster than `ar`",
    ),
    (
        "`embedded`",
        "distilled 6-layer draft (shipped)",
        (["draft-v3-alpha"], "sd@runs/draft-v3", "SD, 30 prompts"),
        "costs-cpu-draft-0e",
        "board-embedded-t0",
        "the paper's regime (the target sets the pace): forks rescue, SpecBranch leads at T=0; the default off a CPU",
    ),
    (
        "`embedded-weak`",
        "distilled 2-layer draft (shipped)",
        (["draft-embedded-weak-t0-n10"], "sd", "SD, 30 prompts"),
        None,
        None,
        "the poorly aligned regime: rollbacks, holds (α 0.10 on the foreign prompts)",
    ),
    (
        "`embedded-head`",
        "EAGLE-style head on the target's features",
        (["bench-cpu-head-t0"], "sd", "SD, 12 prompts"),
        "costs-cpu-head",
        "bench-cpu-head-t0",
        "studying feature-conditioned drafting; not for speed here",
    ),
]


def drafts() -> str:
    rows = []
    for draft, what, (names, method, note), costs, fast, when in DRAFTS:
        alpha = Figures(names).fmt(method, "acceptance_rate", 3, sd=False)
        if costs:
            fw = load(costs)["forwards"]
            step = f"{fw['draft_ms_by_rows']['1']:.1f} / {fw['target_ms_by_tokens']['1']:.1f} ({link([costs])})"
        elif draft == "`embedded-weak`":
            step = f"{Figures(names).fmt(method, 'draft_forward_ms', 1, sd=False)} (the draft, in its SD run)"
        else:
            step = "–"
        if fast:
            f = Figures([fast])
            best = (
                f"pearl {f.fmt('pearl', 'speedup_vs_ar', sd=False)}, "
                f"specbranch {f.fmt(f.shipped(), 'speedup_vs_ar', sd=False)}"
            )
        else:
            best = "see the rollback table"
        rows.append([draft, what, f"{alpha} ({note}; {link(names)})", step, best, when])
    return table(
        ["draft", "what it is", "α at T=0", "draft step / target step, ms", "vs `ar` at T=0", "pick it for"], rows
    )


def bound() -> str:
    rows = []
    for t in (0, 1):
        for s, name in enumerate(SEEDS[t]):
            model = load(f"{name}-model")["model"]
            bench = load(name)["results"]
            m = {k: model["all"][k] for k in ("sd", "pearl", "specbranch")}
            headroom = m["pearl"]["no_waste"] / m["pearl"]["modelled"]
            by_set = ", ".join(
                f"{model[d]['specbranch']['measured'] / model[d]['sd']['measured']:.2f}"
                for d in ("mt_bench", "gsm8k", "humaneval")
            )
            rows.append(
                [
                    str(t),
                    str(s),
                    f"{m['specbranch']['measured'] / m['pearl']['measured']:.3f}",
                    f"{headroom:.3f}",
                    f"{bench['pearl']['all']['wasted_draft_rate']:.3f}",
                    f"{bench['specbranch']['all']['wasted_draft_rate']:.3f}",
                    f"{m['pearl']['pace']}, {m['pearl']['share_of_limit']:.2f}",
                    f"{m['specbranch']['pace']}, {m['specbranch']['share_of_limit']:.2f}",
                    f"{m['specbranch']['measured'] / m['sd']['measured']:.2f} ({by_set})",
                    f"[bench]({'json/' + name}.json), [model]({'json/' + name}-model.json)",
                ]
            )
    return table(
        [
            "T",
            "seed",
            "specbranch / pearl",
            "pearl's no-waste headroom",
            "pearl wasted draft",
            "specbranch wasted draft",
            "pearl: pace, share of its limit",
            "specbranch: pace, share of its limit",
            "specbranch / sd (MT-Bench, GSM8K, HumanEval)",
            "JSON",
        ],
        rows,
    )


# (regime, draft, T, sources, specbranch's settings)
ROLLBACK = [
    ("near-perfect draft", "`self`", 0, [SELF_T0], "hold 0"),
    ("near-perfect draft", "`self`", 1, [SELF_T1], "hold 0"),
    ("mid α, forks rescue", "`self-skip:3,4,5,25`", 0, ["skip3-4-5-25-t0"], "hold 0.5"),
    ("mid α", "`self-skip:4,5`", 0, ["skip4-5-t0"], "hold 0.5"),
    ("mid α", "`self-skip:4,5`", 1, ["skip4-5-t1"], "hold 0.5"),
    ("distilled draft", "`embedded`", 0, ["missed-distilled-t0"], "hold 0.5"),
    ("distilled draft", "`embedded`", 1, ["sampled-distilled-t1"], "hold 0.5"),
    ("distilled draft in 4 bits", "`embedded`", 0, ["int4-embedded-t0"], "hold 0.25"),
    ("distilled draft in 4 bits", "`embedded`", 1, ["int4-embedded-t1"], "hold 0.25"),
    ("distilled draft in 4 bits, the answer board", "`embedded`", 0, ["board-embedded-t0"], "hold 0.25"),
    ("distilled draft in 4 bits, the answer board", "`embedded`", 1, ["board-embedded-t1"], "hold 0.25"),
    ("distilled draft in 4 bits, current engine", "`embedded`", 0, ["grouped-xeon-embedded-t0"], "hold 0.25"),
    ("distilled draft in 4 bits, current engine", "`embedded`", 1, ["grouped-xeon-embedded-t1"], "hold 0.25"),
    ("poorly aligned (foreign prompts)", "`embedded-weak`", 0, ["weak-foreign-0h"], "hold 0"),
    ("poorly aligned (foreign prompts)", "`embedded-weak`", 0, WEAK_OFF, "hold 0.5"),
    ("poorly aligned (foreign prompts)", "`embedded-weak`", 0, WEAK_ON, "hold 0.5, `--hold-branches`"),
]


def rollback() -> str:
    rows = []
    for regime, draft, t, names, settings in ROLLBACK:
        f = Figures(names)
        sb = f.shipped()
        ratio = lambda key: f.get(sb, key)[0] / f.get("pearl", key)[0]  # noqa: E731
        rows.append(
            [
                regime,
                draft,
                str(t),
                f.fmt("sd", "path_rollback_rate", 3, sd=False),
                f.fmt("pearl", "path_rollback_rate", 3, sd=False),
                f.fmt(sb, "path_rollback_rate", 3, sd=False),
                settings,
                f"**{ratio('path_rollback_rate'):.2f}×**",
                f"{ratio('speedup_vs_ar'):.2f}×",
                f.fmt(sb, "branch_rescues", 1, sd=False),
                str(f.n),
                link(names),
            ]
        )
    return table(
        [
            "regime",
            "draft",
            "T",
            "sd",
            "pearl",
            "specbranch",
            "specbranch's settings",
            "specbranch / pearl, path rollback",
            "specbranch / pearl, speed",
            "rescues a run",
            "runs",
            "JSON",
        ],
        rows,
    )


# (draft, how its step runs, costs JSON, measured)
COSTS = [
    ("`self`", "4-bit, lean, eager", "compiled-costs-lean", "2026-11-25"),
    ("`self`", "4-bit, lean, compiled", "compiled-costs-lean-compiled", "2026-11-25"),
    ("`self-skip:3,4,5,25`", "4-bit, lean, eager, shared-prefix branches", "branchkv-costs-B-self-skip", "2026-11-24"),
    ("`embedded`", "float32, lean, compiled; AVX2 CPU", "regime-embedded-costs", "2026-11-27"),
    ("`embedded`", "float32, lean, compiled; AVX2 CPU, panel kernel", "panel-embedded-costs", "2026-11-27"),
    ("`embedded`", "4-bit, lean, compiled; AVX2 CPU, panel kernel", "panel-embedded-int4-costs", "2026-11-27"),
    ("`embedded`", "4-bit, lean, compiled; AVX-512 CPU", "avx512-embedded-int4-costs", "2026-11-28"),
    ("`embedded`", "4-bit, lean, compiled; Intel Xeon, library kernels", "xeon-costs-library", "2026-12-04"),
    ("`embedded`", "4-bit, lean, compiled; Intel Xeon, AVX-512 panel kernel", "xeon-costs-panel", "2026-12-04"),
    (
        "`embedded`",
        "4-bit, lean, compiled; Intel Xeon, panel kernel, grouped attention",
        "xeon-costs-grouped",
        "2026-12-04",
    ),
    ("`embedded`", "bfloat16 matmuls, transformers' forward", "costs-cpu-draft-0e", "2026-11-23"),
    ("`embedded-head`", "float32, 1 layer on the target's features", "costs-cpu-head", "2026-11-22"),
]


def costs() -> str:
    rows = []
    for draft, how, name, when in COSTS:
        fw = load(name)["forwards"]
        ms = lambda d: " / ".join(f"{v:.1f}" for v in d.values())  # noqa: E731
        rows.append(
            [
                draft,
                how,
                ms(fw["target_ms_by_tokens"]),
                ms(fw["draft_ms_by_rows"]),
                ms(fw.get("target_ms_beside_draft_rows", {})) or "–",
                f"{fw['c']:.2f}",
                when,
                link([name]),
            ]
        )
    return table(
        [
            "draft",
            "draft's step",
            "target fed 1, 2, … tokens",
            "draft on 1, 2, … rows",
            "target (1 token) beside 1, 2, … draft rows",
            "c",
            "measured",
            "JSON",
        ],
        rows,
    )


def model() -> str:
    rows = []
    for t in (0, 1):
        models = [load(f"{name}-model")["model"]["all"] for name in SEEDS[t]]
        benches = [load(name)["results"] for name in SEEDS[t]]
        for method in ("sd", "pearl", "specbranch", "specbranch-no-branch", "specbranch-fixed"):
            col = lambda key: [m[method][key] for m in models]  # noqa: E731
            spread = lambda v, d=2: (
                f"{min(v):.{d}f}"
                if f"{min(v):.{d}f}" == f"{max(v):.{d}f}"  # noqa: E731
                else f"{min(v):.{d}f}–{max(v):.{d}f}"
            )
            rows.append(
                [
                    str(t),
                    method,
                    spread(col("measured")),
                    spread(col("modelled")),
                    spread(col("share_of_limit")),
                    spread(col("tau")),
                    spread(col("verify_ms"), 1),
                    spread([b[method]["all"]["draft_forward_ms"] for b in benches], 1),
                    spread(
                        [b[method]["all"]["draft_forwards"] / b[method]["all"]["target_forwards"] for b in benches], 1
                    ),
                    models[0][method]["pace"],
                ]
            )
    return table(
        [
            "T",
            "method",
            "measured vs ar",
            "modelled",
            "share of the limit",
            "τ",
            "T_verify, ms",
            "D, ms",
            "d (draft steps a pass)",
            "pace",
        ],
        rows,
    )


def headline() -> str:
    """The README's headline: one bench run per temperature with no flag but the methods and the dataset, so the
    default draft and its preset (engine/presets.py)."""
    f0, f1 = Figures([HEADLINE_T0]), Figures([HEADLINE_T1])
    run = load(HEADLINE_T0)
    rows = []
    for method in ("sd", "pearl", "specbranch"):
        bold = method == "specbranch"
        cell = lambda f: f"**{f.fmt(method, 'speedup_vs_ar')}**" if bold else f.fmt(method, "speedup_vs_ar")  # noqa
        rows.append(
            [
                f"`{method}`",
                cell(f0),
                cell(f1),
                f0.fmt(method, "acceptance_rate", 3, sd=False),
                f0.fmt(method, "path_rollback_rate", 3, sd=False),
                run["identical_to_ar"][method],
            ]
        )
    out = table(["method", "vs `ar`, T=0", "vs `ar`, T=1", "α, T=0", "path rollback, T=0", "T=0 output = `ar`'s"], rows)
    prompts = run["results"]["ar"]["all"]["prompts"]
    return out + (
        f"\n`ar`: {f0.fmt('ar', 'tokens_per_s', 1)} tokens/s at T=0, {f1.fmt('ar', 'tokens_per_s', 1)} at "
        f"T=1. {prompts} prompts × {run['settings']['max_new_tokens']} tokens, one run each; draft "
        f"`{run['pair']['draft']}`. JSON: {link([HEADLINE_T0, HEADLINE_T1], 'docs/results/json/')}.\n"
    )


def regime() -> str:
    """The regime map's drafts (docs/results/tools/regime_map.py): c, α and each method's speed against `ar`, all
    from one bench run, with the forwards-only model's limit beside the measured speed."""
    data = load("regime-map")
    rows = []
    for draft, e in data["drafts"].items():
        m = e["methods"]
        cell = lambda k: f"{m[k]['measured']:.2f} ({m[k]['modelled']:.2f})"  # noqa: E731
        rows.append([f"`{draft}`", f"{e['c']:.2f}", f"{e['alpha']:.3f}", cell("sd"), cell("pearl"), cell("specbranch")])
    head = ["draft", "c", "α (SD)", "sd × `ar` (model)", "pearl × `ar` (model)", "specbranch × `ar` (model)"]
    return table(head, rows) + f"\nJSON: {link(['regime-map', 'regime-map-bench'])}.\n"


# the costs reports (and the drafts' memory) do not record their command line; these are the commands that wrote them
COSTS_COMMANDS = {
    "draft-memory": "python docs/results/tools/draft_memory.py > docs/results/json/draft-memory.json (last line)",
    "compiled-costs-lean": "python -m engine costs --draft self --draft-forward lean --draft-worker thread "
    "--max-rows 3 --max-tokens 1 --reps 30",
    "compiled-costs-lean-compiled": "python -m engine costs --draft self --draft-forward lean-compiled "
    "--draft-worker thread --max-rows 3 --max-tokens 1 --reps 30",
    "branchkv-costs-B-self-skip": "python -m engine costs --draft self-skip:3,4,5,25 --draft-worker thread "
    "--max-rows 3 --max-tokens 1 --reps 30",
    "costs-cpu-draft-0e": "python -m engine costs --draft embedded --max-rows 3 --max-tokens 4 "
    "--json docs/results/json/costs-cpu-draft-0e.json",
    "costs-cpu-head": "python -m engine costs --draft embedded-head --reps 30 "
    "--bench docs/results/json/bench-cpu-head-t0.json",
    "regime-embedded-costs": "python -m engine costs --draft embedded "
    "--bench docs/results/json/regime-embedded-t0.json --json docs/results/json/regime-embedded-costs.json",
    "xeon-costs-library": "python -m engine costs --draft embedded --max-tokens 8 --max-rows 4 --reps 15 "
    "--json docs/results/json/xeon-costs-library.json (the engine before the AVX-512 panel kernel)",
    "xeon-costs-panel": "python -m engine costs --draft embedded --max-tokens 8 --max-rows 4 --reps 15 "
    "--json docs/results/json/xeon-costs-panel.json (the engine before grouped attention)",
    "xeon-costs-grouped": "python -m engine costs --draft embedded --max-tokens 8 --max-rows 4 --reps 15 "
    "--json docs/results/json/xeon-costs-grouped.json",
    "panel-embedded-costs": "python -m engine costs --draft embedded --max-tokens 10 "
    "--json docs/results/json/panel-embedded-costs.json",
    "panel-embedded-int4-costs": "python -m engine costs --draft embedded --draft-matmul int4 "
    "--json docs/results/json/panel-embedded-int4-costs.json",
    "avx512-embedded-int4-costs": "python -m engine costs --draft embedded --max-tokens 12 --max-rows 4 --reps 15 "
    "--json docs/results/json/avx512-embedded-int4-costs.json",
    "few-rows": "python docs/results/tools/few_rows.py --json docs/results/json/few-rows.json",
    "few-rows-avx512": "python docs/results/tools/few_rows.py --json docs/results/json/few-rows-avx512.json",
    "few-rows-avx512-amd": "python docs/results/tools/few_rows.py --json docs/results/json/few-rows-avx512-amd.json "
    "(AuthenticAMD added to panel.AVX512_VENDORS)",
    # the AMD EPYC's A/B of the target's forward: library then panel kernel, and again with the order swapped
    **{
        name + suffix: "python -m engine costs --draft embedded --max-tokens 8 --max-rows 4 --reps 15 "
        f"--json docs/results/json/{name}{suffix}.json ({what}; {order})"
        for name, what in (
            ("amd-costs-library", "the engine of 04d0766: the library's kernels on an AMD CPU"),
            ("amd-costs-panel", "the AVX-512 panel kernel on the AMD CPU"),
        )
        for suffix, order in (("", "first of a pair"), ("-run2", "the pair again, the other order first"))
    },
    "regime-map": "python docs/results/tools/regime_map.py --bench docs/results/json/regime-map-bench.json "
    "--json docs/results/json/regime-map.json",
}


def as_run_now(command: str, name: str | None = None) -> str:
    """A recorded command line as it runs today: `python -m engine` for the script's path, and the JSON paths where
    the results live now, docs/results/json/ (they were written to docs/, or to a folder of that machine, and copied
    here): the report it writes is `name`'s where given (one run), and the bench reports it reads are here too."""
    command = re.sub(r"^\S*engine/__main__\.py", "python -m engine", command)
    command = re.sub(r"--bench \S*/([\w.-]+\.json)", r"--bench docs/results/json/\1", command)
    if name is not None:
        return re.sub(r"--json \S+?\.json", f"--json docs/results/json/{name}.json", command)
    return re.sub(r"--json \S*/([\w.-]+\.json)", r"--json docs/results/json/\1", command)


def command_of(name: str) -> tuple[str, str]:
    """(the command that wrote a JSON file, when)."""
    data = load(name)
    if name in COSTS_COMMANDS:
        return COSTS_COMMANDS[name], "–"
    if name.endswith("-model"):
        return f"python -m engine costs --bench docs/results/json/{name[:-6]}.json --model-only", "–"
    if "runs" in data and "command" not in data:  # a summary over seeds (engine summarize)
        first = as_run_now(data["runs"][0]["command"])
        seeds = ", ".join(str(run["seed"]) for run in data["runs"])
        return f"{first}, for seeds {seeds}; then python -m engine summarize over them", "–"
    return as_run_now(data["command"], name), data.get("when", "–")


def sources() -> str:
    rows = []
    for path in sorted(JSON.glob("*.json")):
        command, when = command_of(path.stem)
        rows.append([link([path.stem]), f"`{command}`", when])
    return table(["JSON", "command (as recorded; results JSON paths as they are now)", "when"], rows)


TABLES = {
    "speed": speed,
    "drafts": drafts,
    "bound": bound,
    "rollback": rollback,
    "costs": costs,
    "model": model,
    "sources": sources,
    "headline": headline,
    "regime": regime,
}


def render(text: str) -> str:
    return MARKER.sub(lambda m: m.group(1) + TABLES[m.group(2)]() + m.group(4), text)


def main(argv: list[str]) -> int:
    check = "--check" in argv
    stale = []
    for path in FILES:
        if not path.exists():
            continue
        text = path.read_text()
        new = render(text)
        if new != text:
            stale.append(path)
            if not check:
                path.write_text(new)
    for path in stale:
        print(f"{'stale' if check else 'rewrote'}: {path}")
    return 1 if check and stale else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
