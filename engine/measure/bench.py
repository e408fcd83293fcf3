"""`python -m engine bench`: every method on the same prompts in the same run, interleaved per
prompt so that machine drift hits all methods alike; speedups are against `ar` from this run."""

from __future__ import annotations

import dataclasses
import json
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from engine.config import BASELINE, GenerationConfig, SpecBranchError, method_of, writable_file, write_json
from engine.kernels import cpu, panel
from engine.measure.datasets import benchmark_prompts
from sessions.recording import SessionLog

SUMMED = (
    "new_tokens",
    "drafted_tokens",
    "verified_tokens",
    "accepted_tokens",
    "wasted_draft_tokens",
    "path_drafted_tokens",
    "path_rolled_back_tokens",
    "target_forwards",
    "draft_forwards",
)


def ratio(part: int, whole: int) -> float | None:
    return round(part / whole, 4) if whole else None


def aggregate(runs: list[dict]) -> dict:
    """Pool per-prompt metrics: ratios of sums, time-weighted fractions."""
    tot = {k: sum(r[k] for r in runs) for k in SUMMED}
    decode_s = sum(r["decode_s"] for r in runs)
    after_prefill = sum(r["tokens_per_s"] * r["decode_s"] for r in runs)

    def weighted(key):
        vals = [(r[key], r["decode_s"]) for r in runs if r.get(key) is not None]
        return round(sum(v * w for v, w in vals) / sum(w for _, w in vals), 4) if vals else None

    return {
        "prompts": len(runs),
        **tot,
        "decode_s": round(decode_s, 3),
        "tokens_per_s": round(after_prefill / decode_s, 3) if decode_s else 0.0,
        "acceptance_rate": round(tot["accepted_tokens"] / tot["verified_tokens"], 4)
        if tot["verified_tokens"]
        else None,
        # τ needs every run's target forwards; hf-assisted's are invisible to us (its runs report None)
        "mean_accepted_length": (
            round(tot["new_tokens"] / tot["target_forwards"], 4)
            if tot["target_forwards"] and all(r.get("mean_accepted_length") is not None for r in runs)
            else None
        ),
        # the two rollback figures (engine.measure.metrics.draft_waste) of finished runs, pooled as ratios of sums
        "path_rollback_rate": ratio(tot["path_rolled_back_tokens"], tot["path_drafted_tokens"]),
        "wasted_draft_rate": ratio(tot["wasted_draft_tokens"], tot["drafted_tokens"]),
        "target_idle_fraction": weighted("target_idle_fraction"),
        "draft_idle_fraction": weighted("draft_idle_fraction"),
        "overlap": weighted("overlap"),
        "target_alone_fraction": weighted("target_alone_fraction"),
        "draft_alone_fraction": weighted("draft_alone_fraction"),
        "neither_fraction": weighted("neither_fraction"),
        "target_forward_ms": weighted("target_forward_ms"),
        "draft_forward_ms": weighted("draft_forward_ms"),
        "host_overhead_ms_per_step": weighted("host_overhead_ms_per_step"),
        "per_position_acceptance": pooled_positions(runs),
        "branch_points": sum(r.get("branch_points", 0) for r in runs),
        "branch_rescues": sum(r.get("branch_rescues", 0) for r in runs),
        **pooled_branch_counts(runs),
    }


def pooled_branch_counts(runs: list[dict]) -> dict:
    """engine.measure.metrics.branch_counts summed over runs."""
    by_k: dict[str, list[int]] = {}
    by_depth: list[list[int]] = []
    for r in runs:
        for k, (rescued, n) in (r.get("rescues_by_k") or {}).items():
            c = by_k.setdefault(k, [0, 0])
            c[0], c[1] = c[0] + rescued, c[1] + n
        for d, (rescued, n) in enumerate(r.get("rescues_by_depth") or []):
            by_depth += [[0, 0] for _ in range(d + 1 - len(by_depth))]
            by_depth[d][0] += rescued
            by_depth[d][1] += n
    return {"rescues_by_k": dict(sorted(by_k.items(), key=lambda kv: int(kv[0]))), "rescues_by_depth": by_depth}


def pooled_positions(runs: list[dict]) -> list[float | None]:
    """P(accept at draft position i | all before accepted), pooled over runs from their counts."""
    width = max((len(r.get("per_position_counts") or []) for r in runs), default=0)
    passed, reached = [0] * width, [0] * width
    for r in runs:
        for i, (p, n) in enumerate(r.get("per_position_counts") or []):
            passed[i] += p
            reached[i] += n
    return [round(p / n, 4) if n else None for p, n in zip(passed, reached)]


def calibration_report(entries: list[tuple[str, object, GenerationConfig]]) -> dict:
    """What each SpecBranch variant's runs measured (Engine.calibration keeps one table per method): the target's
    acceptance of drafted tokens by the draft's confidence, and a fork's rescues by its alternatives' share.
    The top-level pair is `specbranch`'s, where it ran (the key earlier reports have)."""
    tables = {}
    for label, eng, cfg in entries:
        if cfg.kind.calibrated:
            tables[label] = {
                "acceptance_by_confidence": eng.calibration(cfg).table(),
                "rescue_by_share": eng.calibration(cfg, "rescue").table(),
            }
    return {
        **tables.get("specbranch", {"acceptance_by_confidence": [], "rescue_by_share": []}),
        "calibration_by_method": tables,
    }


def draft_forward_kind(draft, method: str) -> str | None:
    """How a method's draft steps ran: "lean-compiled" (the lean path with its one-token step compiled, the compile
    landed), "lean", "transformers" (hf-assisted hands transformers' generate() the draft model itself: never the
    lean path), None without a draft."""
    kind = method_of(method)
    if draft is None or not kind.needs_draft:
        return None
    if not kind.drafts_here or not draft.lean:
        return "transformers"
    return "lean-compiled" if draft.compile_status()[0] == "compiled" else "lean"


# the report's "settings": what the flags and --draft's preset set for every entry (BenchSpec.settings), and the prompts
SETTINGS_KEYS = (
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "gamma",
    "draft_stop",
    "feed_stop",
    "head_start",
    "branches",
    "epsilon",
    "hrad",
    "branch_costs",
    "calibrate",
    "hold",
    "hold_branches",
)


@dataclass(frozen=True)
class BenchSpec:
    """What a bench runs besides its entries: the prompts, the untimed warm-up runs and where the report goes."""

    settings: GenerationConfig  # the flags over --draft's preset (the report's "settings"; its method is not read)
    dataset: str = "mt_bench"  # mt_bench | gsm8k | humaneval | all | PATH.jsonl
    limit: int = 10  # prompts per dataset
    warmup: int = 1  # untimed generations per entry, before the timed ones
    json_out: str | None = None  # where to write the report, if anywhere


Entry = tuple[str, object, GenerationConfig]  # (label, engine, its settings)


def encoded_prompts(spec: BenchSpec, engine) -> list[tuple[object, list[int]]]:
    """(prompt, its token ids) of every benchmark prompt the spec names."""
    datasets = ["mt_bench", "gsm8k", "humaneval"] if spec.dataset == "all" else [spec.dataset]
    prompts = [p for d in datasets for p in benchmark_prompts(d, spec.limit)]
    return [(p, engine.encode(p.text, p.chat)) for p in prompts]


def run_prompts(entries: list[Entry], encoded, log: SessionLog) -> tuple[dict, dict]:
    """Every entry on each prompt in turn, each prompt one recorded session: (per entry, per dataset: the runs'
    metrics; per entry but `ar`: how many outputs were `ar`'s)."""
    per_run: dict[str, dict[str, list[dict]]] = {label: {} for label, _, _ in entries}
    outputs_match = {label: 0 for label, _, _ in entries if label != BASELINE}
    for p, ids in tqdm(encoded, desc="bench", unit="prompt", file=sys.stderr):
        reference = None
        for i, (label, eng, cfg) in enumerate(entries):
            recorder = log.start(p.text, entries[0][2]) if i == 0 else log.another()
            try:
                r = eng.run(ids, cfg, p.text, on_event=recorder.add)
            finally:
                log.finish(recorder)
            per_run[label].setdefault(p.dataset, []).append(r.metrics)
            if label == BASELINE:
                reference = r.token_ids
            elif reference is not None and r.token_ids == reference:
                outputs_match[label] += 1
    return per_run, outputs_match


def pooled_results(per_run: dict[str, dict[str, list[dict]]]) -> dict:
    """Per entry, per dataset and "all": the pooled metrics (aggregate) and the speedup against `ar`'s."""
    results = {}
    for m, by_dataset in per_run.items():
        results[m] = {d: aggregate(runs) for d, runs in by_dataset.items()}
        results[m]["all"] = aggregate([x for runs in by_dataset.values() for x in runs])
    for m in results:
        for d, agg in results[m].items():
            base = results.get(BASELINE, {}).get(d, {}).get("tokens_per_s")
            agg["speedup_vs_ar"] = round(agg["tokens_per_s"] / base, 3) if base else None
    return results


def how_drafts_ran(entries: list[Entry]) -> dict:
    """Per entry: its draft, how the draft's matmuls read its weights, how its steps ran and where."""
    return {
        "drafts": {label: eng.pair.draft.name if eng.pair.draft else None for label, eng, _ in entries},
        "draft_matmul": {
            label: eng.pair.draft.matmul if eng.pair.draft and cfg.kind.needs_draft else None
            for label, eng, cfg in entries
        },
        "target_forward": "static" if entries[0][1].pair.target.static else "transformers",
        "draft_forward": {label: draft_forward_kind(eng.pair.draft, cfg.method) for label, eng, cfg in entries},
        # hf-assisted runs the local draft's model on transformers' own loop, in this process
        "draft_worker": {
            label: (eng.pair.draft_worker if cfg.kind.drafts_here else "thread")
            if eng.pair.draft and cfg.kind.needs_draft
            else None
            for label, eng, cfg in entries
        },
    }


def command_line() -> str:
    """How this run was started, as a reader would type it: `python -m engine ...` (sys.argv[0] is the absolute path
    of engine/__main__.py there, which names nothing on another machine); other entries as given."""
    first = Path(sys.argv[0])
    head = "python -m engine" if first.parts[-2:] == ("engine", "__main__.py") else first.name
    return " ".join([head, *sys.argv[1:]])


def bench_report(entries: list[Entry], spec: BenchSpec, results: dict, outputs_match: dict, prompts: int) -> dict:
    engine = entries[0][1]
    return {
        "command": command_line(),
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": {
            "platform": platform.platform(),
            "cpu": cpu.name(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "device": str(engine.pair.target.device),
            "few_row_kernel": panel.why_not() or "on",  # kernels/panel.py: on, or why the library's kernels ran
        },
        "pair": {"target": engine.pair.target.name, "draft": engine.pair.draft.name if engine.pair.draft else None},
        **how_drafts_ran(entries),
        "settings": {
            **{k: getattr(spec.settings, k) for k in SETTINGS_KEYS},
            "limit": spec.limit,
            "dataset": spec.dataset,
        },
        # each entry's own settings: a METHOD@DRAFT entry starts from its draft's preset (engine/presets.py)
        "settings_by_method": {label: cfg.to_dict() for label, _, cfg in entries},
        # --branch-costs: the forward costs measured once per draft and forked by (ms; keys: draft rows)
        "branch_costs": {
            eng.pair.draft.name: dataclasses.asdict(eng.measured_branch_costs)
            for _, eng, _ in entries
            if eng.measured_branch_costs is not None
        },
        "identical_to_ar": (
            {m: f"{n}/{prompts}" for m, n in outputs_match.items()}
            if spec.settings.temperature == 0 and BASELINE in results
            else None
        ),
        "results": results,
        **calibration_report(entries),
    }


def run_bench(entries: list[Entry], spec: BenchSpec, log: SessionLog | None = None) -> dict:
    """Every entry runs each prompt in turn (so that a drift of the machine's speed hits them alike); `ar` is the
    reference. Prints the table, writes the report where spec.json_out says, returns it."""
    encoded = encoded_prompts(spec, entries[0][1])
    for _ in range(spec.warmup):
        for _, eng, cfg in entries:
            eng.run(encoded[0][1], cfg)
    per_run, outputs_match = run_prompts(entries, encoded, log or SessionLog())
    report = bench_report(entries, spec, pooled_results(per_run), outputs_match, len(encoded))
    print(format_table(report))
    write_json(spec.json_out, report)
    return report


def pipe_table(head: list[str], rows: list[list[str]]) -> str:
    """A table printed as pipe-separated lines: the head, a rule, a line per row."""
    return "\n".join(" | ".join(cells) for cells in [head, ["---"] * len(head), *rows])


def format_table(report: dict) -> str:
    cols = [
        "tokens_per_s",
        "speedup_vs_ar",
        "acceptance_rate",
        "mean_accepted_length",
        "path_rollback_rate",
        "wasted_draft_rate",
        "wasted_draft_tokens",
        "target_idle_fraction",
        "draft_idle_fraction",
        "overlap",
        "draft_alone_fraction",
        "target_forward_ms",
        "draft_forward_ms",
        "host_overhead_ms_per_step",
        "branch_rescues",
    ]
    head = [
        "method",
        "dataset",
        "tok/s",
        "speedup",
        "α",
        "τ",
        "path rollback",
        "wasted draft",
        "wasted tokens",
        "idle T",
        "idle D",
        "overlap",
        "D alone",
        "T ms",
        "D ms",
        "host ms/step",
        "rescues",
    ]
    rows = [
        [m, d] + ["" if agg.get(c) is None else f"{agg[c]:.3g}" for c in cols]
        for m, per_ds in report["results"].items()
        for d, agg in per_ds.items()
    ]
    lines = [pipe_table(head, rows)]
    if report.get("identical_to_ar"):
        lines.append("identical to ar (greedy): " + ", ".join(f"{m} {v}" for m, v in report["identical_to_ar"].items()))
    return "\n".join(lines)


SPREAD_KEYS = (
    "tokens_per_s",
    "speedup_vs_ar",
    "acceptance_rate",
    "mean_accepted_length",
    "path_rollback_rate",
    "wasted_draft_rate",
    "branch_rescues",
    "overlap",
    "target_idle_fraction",
    "draft_alone_fraction",
)


def summarize_runs(reports: list[dict], dataset: str = "all") -> dict:
    """Several bench reports of the same methods (one per seed): mean and sample standard deviation of each
    figure per method, over the reports that have it."""
    methods = [m for m in reports[0]["results"] if all(m in r["results"] for r in reports)]
    out = {}
    for m in methods:
        row = {}
        for key in SPREAD_KEYS:
            vals = [r["results"][m][dataset].get(key) for r in reports]
            vals = [v for v in vals if v is not None]
            row[key] = (
                {
                    "mean": round(statistics.fmean(vals), 4),
                    "sd": round(statistics.stdev(vals), 4) if len(vals) > 1 else 0.0,
                    "n": len(vals),
                }
                if vals
                else None
            )
        out[m] = row
    return {
        "runs": [
            {"command": r["command"], "seed": r["settings"]["seed"], "temperature": r["settings"]["temperature"]}
            for r in reports
        ],
        "dataset": dataset,
        "methods": out,
    }


def format_spread_table(summary: dict) -> str:
    head = [
        "method",
        "tok/s",
        "speedup",
        "α",
        "τ",
        "path rollback",
        "wasted draft",
        "rescues",
        "overlap",
        "idle T",
        "D alone",
    ]
    rows = [
        [m] + [f"{row[k]['mean']:.3g} ± {row[k]['sd']:.2g}" if row[k] else "" for k in SPREAD_KEYS]
        for m, row in summary["methods"].items()
    ]
    return pipe_table(head, rows)


def read_report(path: str) -> dict:
    """A bench JSON (`bench --json`), or a SpecBranchError that says why it cannot be one."""
    try:
        with open(path) as f:
            report = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise SpecBranchError(f"cannot read bench report {path}: {exc}") from None
    if not isinstance(report, dict) or not isinstance(report.get("results"), dict):
        raise SpecBranchError(f"{path} is not a bench report (no 'results')")
    return report


def run_summary(paths: list[str], dataset: str = "all", json_out: str | None = None) -> dict:
    """`python -m engine summarize`: mean ± sd per method over the bench reports at `paths`."""
    writable_file(json_out, "summary")
    reports = [read_report(path) for path in paths]
    summary = summarize_runs(reports, dataset)
    print(format_spread_table(summary))
    write_json(json_out, summary)
    return summary
