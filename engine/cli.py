"""The command line, `python -m engine generate | bench | summarize | costs | distill | train-hrad | gpu-check`. It
parses; engine/presets.py gives each draft's settings where no flag does; each command hands typed settings to the
library (GenerationConfig, ModelSettings, BenchSpec, CostsSpec, DistillSpec, HradSpec). Every argument is defined
once, here or (the model flags, which the app shares) in engine/args.py (docs/cli.md)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from engine.args import (
    add_model_arguments,
    fill_model_defaults,
    layer_list,
    model_settings,
    settings_from,
    thread_count,
    word_list,
)
from engine.config import BASELINE, METHODS, REGISTRY, GenerationConfig, SpecBranchError, writable_file


def add_sampling_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--gamma",
        type=int,
        default=None,
        help="draft block length (sd); depth cap of the speculation (pearl, specbranch: the draft drafts "
        "until the target's verdict lands or the cap is reached)",
    )
    p.add_argument(
        "--draft-stop",
        type=float,
        default=None,
        help="pearl, specbranch: end a round's drafting after a token drawn with confidence below this",
    )
    p.add_argument(
        "--feed-stop",
        type=float,
        default=None,
        help="pearl, specbranch: feed the target drafted tokens only while the odds that all are "
        "accepted stay at least this (0 = up to γ; the next token is judged anyway)",
    )
    p.add_argument(
        "--head-start",
        type=float,
        default=None,
        help="pearl, specbranch: before a target pass on a block shorter than γ (after a rejection), let "
        "the draft step first while its odds that the whole block is accepted stay >= this (0 = off)",
    )
    add_specbranch_arguments(p)


def add_specbranch_arguments(p: argparse.ArgumentParser) -> None:
    """SpecBranch's own settings (its ablations read them too)."""
    p.add_argument("--branches", type=int, default=3, help="specbranch: most candidates at a branch point")
    p.add_argument(
        "--tree-tokens",
        type=int,
        default=None,
        help="specbranch: branch tokens a target pass may verify beside a path of γ, as one token tree "
        "(0 = only in the room a shorter path leaves)",
    )
    p.add_argument("--epsilon", type=float, default=None, help="specbranch: confidence threshold for branching, [0, 1]")
    p.add_argument(
        "--hrad",
        dest="hrad",
        action="store_true",
        default=None,
        help="specbranch: let H-RAD place branch points (off by default: on held-out prompts it did not "
        "beat confidence only, docs/methods.md)",
    )
    p.add_argument("--no-hrad", dest="hrad", action="store_false", help="specbranch: confidence only (the default)")
    p.add_argument(
        "--branch-costs",
        action="store_true",
        help="specbranch: fork only where the measured forward costs say a fork pays (measured once "
        "per engine: a draft step on 1..k rows, a target step beside k draft rows): a rescue saves "
        "drafting the surviving branch, a fork costs its steps on k rows",
    )
    p.add_argument(
        "--calibrate",
        dest="calibrate",
        action="store_true",
        default=True,
        help="specbranch: compare with ε, and size k by, the acceptance the engine measured at the draft's "
        "confidence (engine/methods/calibration.py; the default)",
    )
    p.add_argument(
        "--no-calibrate",
        dest="calibrate",
        action="store_false",
        help="specbranch: the draft's confidence as is (the paper's rule)",
    )
    p.add_argument(
        "--hold",
        type=float,
        default=None,
        help="specbranch: draft nothing where the odds that it is accepted (read as for ε) fall below "
        "this, and leave that position to the target: no token is drafted only to be rolled back "
        "(0 = off)",
    )
    p.add_argument(
        "--hold-branches",
        action="store_true",
        default=None,
        help="specbranch, with --hold: also keep nothing of a branch step where the first branch's odds "
        "with the token it would add fall below the hold (fewer branch tokens rolled back; costs τ "
        "where branch tokens are often accepted, docs/methods.md)",
    )


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The parsed command line, with the draft and its forward filled where no flag gave them
    (args.fill_model_defaults)."""
    return fill_model_defaults(build_parser().parse_args(argv))


def given_settings(args: argparse.Namespace) -> dict:
    """The GenerationConfig fields the command line gave: a flag left at None was not given (a draft's preset fills
    it: presets.config_for); the others have their defaults."""
    names = (f.name for f in dataclasses.fields(GenerationConfig) if f.name != "method")
    return {k: getattr(args, k) for k in names if getattr(args, k, None) is not None}


def generation_config(args: argparse.Namespace, method: str, draft: str | None = None) -> GenerationConfig:
    """The settings `method` runs with on `draft` (default: --draft): the flags over that draft's preset,
    validated."""
    from engine.presets import config_for

    return config_for(method, args.draft if draft is None else draft, given_settings(args)).validate()


def add_record_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--record", action="store_true", help="record every run to the session store (SQLite)")
    p.add_argument("--db", default=None, help="session store file (default: $SPECBRANCH_DB or the data dir)")
    p.add_argument("--share", action="store_true", help="with --record: mark sessions shared (visible to all)")


def add_distill_arguments(p: argparse.ArgumentParser) -> None:
    """`distill`'s own arguments."""
    p.add_argument("--target", default="embedded")
    p.add_argument("--corpus", action="append", help="JSONL rows with prompt_ids and response_ids (repeatable)")
    p.add_argument("--prompts", help="JSONL prompts (field 'prompt', optional 'chat') to generate responses for")
    p.add_argument("--limit", type=int, default=0, help="use only the first N prompts")
    p.add_argument(
        "--self-prompts",
        type=int,
        default=0,
        help="let the target write N user questions of its own (Magpie) and answer them",
    )
    p.add_argument(
        "--self-prompt-leads",
        type=word_list,
        default=None,
        help="with --self-prompts: open the questions with these words in turn, comma-separated (e.g. "
        "'Write,Summarize,Act as'), for task-style instructions the target seldom writes unprompted",
    )
    p.add_argument("--generate-only", action="store_true", help="stop after generating responses")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--gen-batch-size", type=int, default=16)
    p.add_argument("--gen-temperature", type=float, default=0.0)
    p.add_argument("--max-tokens", type=int, default=0, help="cap on response tokens used (0 = all)")
    p.add_argument(
        "--kind",
        choices=("standalone", "head"),
        default="standalone",
        help="standalone: the target's first N layers as a small LM; head: a feature-conditioned "
        "draft head over the target's last hidden state (EAGLE-style)",
    )
    p.add_argument("--layers", type=int, default=4, help="decoder layers (standalone draft or head)")
    add_draft_shape_arguments(p)
    p.add_argument("--vocab", type=int, default=8192, help="reduced LM-head size (FR-Spec); >= vocab means full")
    p.add_argument("--epochs", type=float, default=3)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--label-batch-size", type=int, default=8)
    p.add_argument("--top-k", type=int, default=32, help="teacher probabilities kept per position")
    p.add_argument("--val-fraction", type=float, default=0.03)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-minutes", type=float, default=None, help="stop training after this long")
    p.add_argument("--threads", type=thread_count, default=0)
    p.add_argument("--device", default=None)
    p.add_argument("--work-dir", default="runs/distill")
    p.add_argument("--out", required=True, help="directory to write the draft to")


def add_draft_shape_arguments(p: argparse.ArgumentParser) -> None:
    """`distill`'s arguments for what the draft starts from and learns: --init, --grow, --unroll, the fused feature
    layers, hard labels, the held-out rows."""
    p.add_argument(
        "--init",
        help="standalone: go on training this saved draft (its layers; --layers is ignored) "
        "instead of starting from the target's first layers",
    )
    p.add_argument(
        "--grow",
        type=int,
        default=0,
        help="standalone, with --init: add N layers on top that start as no-ops (their output projections zero)",
    )
    p.add_argument(
        "--unroll",
        type=int,
        default=3,
        help="head: training-time-test steps (drafting depths trained on the head's own predictions)",
    )
    p.add_argument(
        "--feature-layers",
        type=layer_list,
        default=None,
        help="head: fuse these of the target's hidden states (0 = embeddings, i = layer i's output, L = the "
        "final-norm state), e.g. 2,15,27 for low, mid and high of 30 layers (EAGLE-3); default: the final-norm state",
    )
    p.add_argument(
        "--hard-labels",
        action="store_true",
        help="standalone: train on the answers' own tokens (no target pass to label them); the held-out rows keep "
        "the target's top-k",
    )
    p.add_argument(
        "--held-out",
        help="hold out these rows (a JSONL corpus; training rows with their prompts are dropped) instead of a "
        "random split, so held-out figures stay comparable as corpora are added",
    )
    p.add_argument("--eval-every", type=int, default=0, help="held-out evaluation every N steps too")


def add_hrad_arguments(p: argparse.ArgumentParser) -> None:
    """`train-hrad`'s own arguments (besides the model and sampling arguments)."""
    p.add_argument(
        "--corpus",
        action="append",
        help="training prompts (prompt_ids), repeatable (default: "
        "data/teacher_smollm2_135m.jsonl.gz, data/self_smollm2_135m.jsonl.gz, data/self2_smollm2_135m.jsonl.gz)",
    )
    p.add_argument("--limit", type=int, default=600, help="training prompts (with the target's greedy answer) to read")
    p.add_argument("--held-out-limit", type=int, default=4, help="benchmark prompts per dataset for accuracy")
    p.add_argument("--horizon", type=int, default=4, help="accepted run at which a block counts as all accepted")
    p.add_argument("--val-fraction", type=float, default=0.2, help="training prompts held out for validation")
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--proj-dim", type=int, default=8, help="PCA directions kept of the 5·H target features")
    p.add_argument("--hidden", type=int, default=64, help="MLP width")
    p.add_argument("--dropout", type=float, default=0.2)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument(
        "--samples",
        default="runs/hrad/samples.pt",
        help="collected samples, reused when collected for the same weights and settings",
    )
    p.add_argument("--out", required=True, help="path of the .safetensors to write (a .json goes beside it)")


def session_log(args: argparse.Namespace, engine):
    """The runs' log: recording to the store (--record, --db, --share), or not recording."""
    from sessions import SessionLog

    if not args.record:
        return SessionLog()
    pair = engine.pair
    return SessionLog.open(args.db, (pair.target.name, pair.draft.name if pair.draft else None), args.share)


def read_prompts(args: argparse.Namespace) -> list[str]:
    """`generate`'s prompts: --prompt, or the 'prompt' field of each row of --prompt-file."""
    from pathlib import Path

    from engine.training.common import read_jsonl

    if args.prompt is None and args.prompt_file is None:
        raise SpecBranchError("give --prompt TEXT or --prompt-file F.jsonl")
    if args.prompt is not None:
        return [args.prompt]
    return [r.get("prompt", "") for r in read_jsonl(Path(args.prompt_file))]


def print_result(result, as_json: bool) -> None:
    """A run's notices on stderr; its text (and a line of figures on stderr), or one JSON object."""
    for e in result.events:
        if e.type == "notice":
            print(f"{e.level}: {e.message}", file=sys.stderr)
    if as_json:
        record = {
            "method": result.method,
            "token_ids": result.token_ids,
            "text": result.text,
            "finish_reason": result.finish_reason,
            "metrics": result.metrics,
        }
        print(json.dumps(record), flush=True)
        return
    print(result.text)
    m = result.metrics
    print(
        f"[{result.method}] {m['new_tokens']} tokens, {m['tokens_per_s']} tok/s, "
        f"acceptance {m['acceptance_rate']}, tokens/target forward {m['mean_accepted_length']}, "
        f"path rollback {m['path_rollback_rate']}, wasted draft {m['wasted_draft_rate']}",
        file=sys.stderr,
    )


def cmd_generate(args) -> None:
    from engine.load import load_engine

    cfg = generation_config(args, args.method)
    prompts = read_prompts(args)
    engine = load_engine(model_settings(args), need_draft=REGISTRY[args.method].needs_draft)
    log = session_log(args, engine)
    for prompt in prompts:
        ids = engine.encode(prompt, args.chat)
        recorder = log.start(prompt, cfg)
        try:
            result = engine.run(ids, cfg, prompt, on_event=recorder.add)
        finally:
            log.finish(recorder)
        print_result(result, args.json)


def parse_bench_methods(spec: str) -> list[tuple[str, str, str | None]]:
    """'ar,sd,hf-assisted@embedded' -> [(label, method, draft spec or None for --draft)]."""
    out = []
    for item in (m.strip() for m in spec.split(",")):
        if not item:
            continue
        method, sep, draft = item.partition("@")
        if method not in METHODS:
            raise SpecBranchError(
                f"unknown method {method!r} in --methods; choose from {', '.join(METHODS)} "
                f"(METHOD@DRAFT runs a method with another draft)"
            )
        if sep and not draft:
            raise SpecBranchError(f"--methods: {item!r} names no draft after '@'")
        out.append((item, method, draft or None))
    if not out:
        raise SpecBranchError("--methods names no method")
    if len({label for label, _, _ in out}) < len(out):
        raise SpecBranchError("--methods names a method twice")
    return out


def cmd_bench(args) -> None:
    from engine.load import engine_for, load_engine, pair_for
    from engine.measure.bench import BenchSpec, run_bench
    from engine.presets import config_for

    entries = parse_bench_methods(args.methods)
    # each entry's settings: its draft's preset where no flag gave them; validated before any model loads
    configs = {label: generation_config(args, method, draft) for label, method, draft in entries}
    writable_file(args.json_out, "bench results")
    models = model_settings(args)
    engine = load_engine(models, need_draft=any(REGISTRY[m].needs_draft and d is None for _, m, d in entries))
    engines = {None: engine}
    for draft in sorted({d for _, _, d in entries if d is not None}):  # other drafts share the loaded target
        engines[draft] = engine_for(models, pair_for(models, draft, target=engine.pair.target))
    spec = BenchSpec(
        settings=config_for(BASELINE, args.draft, given_settings(args)),  # the report's "settings"
        dataset=args.dataset,
        limit=args.limit,
        warmup=args.warmup,
        json_out=args.json_out,
    )
    run_bench([(label, engines[d], configs[label]) for label, _, d in entries], spec, session_log(args, engine))


def cmd_summarize(args) -> None:
    from engine.measure.bench import run_summary

    run_summary(args.reports, args.dataset, args.json_out)


def cmd_train_hrad(args) -> None:
    from engine.training.hrad import HradSpec, run_train_hrad

    generation_config(args, "specbranch")  # refuses bad sampling flags before anything loads
    run_train_hrad(settings_from(HradSpec, args), model_settings(args))


def cmd_costs(args) -> None:
    from engine.load import load_engine
    from engine.measure.bench import read_report
    from engine.measure.costs import CostsSpec, run_costs

    writable_file(args.json_out, "costs")
    if args.model_only and not args.bench:
        raise SpecBranchError("--model-only models a bench JSON: name one with --bench")
    report = read_report(args.bench) if args.bench else None  # refused before any model loads
    engine = None if args.model_only else load_engine(model_settings(args), need_draft=args.draft != "none")
    run_costs(engine, settings_from(CostsSpec, args), report)


def cmd_distill(args) -> None:
    from engine.training.common import DistillSpec
    from engine.training.distill import run_distill

    run_distill(settings_from(DistillSpec, args))


def cmd_gpu_check(args) -> None:
    from pathlib import Path

    import torch

    from engine.measure.gpu_check import SECTIONS, run_check

    sections = tuple(s.strip() for s in args.sections.split(",") if s.strip())
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown or not sections:
        raise SpecBranchError(
            f"--sections: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(SECTIONS)}"
        )
    if not args.dry_run and not torch.cuda.is_available():
        raise SpecBranchError("gpu-check needs a CUDA device; on a CPU, --dry-run runs every section with tiny shapes")
    out = Path(args.out)
    writable_file(str(out / "results.json"), "the device check's results")
    results = run_check(out, args.dry_run, sections)
    failed = [name for name, s in results["sections"].items() if s["status"] != "ok"]
    print(f"wrote {out / 'results.json'}" + (f"; not ok: {', '.join(failed)}" if failed else "; every section ok"))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m engine", description="SpecBranch Studio engine")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text with one method")
    add_generate_arguments(g)
    g.set_defaults(func=cmd_generate)

    b = sub.add_parser("bench", help="compare methods on a dataset")
    add_bench_arguments(b)
    b.set_defaults(func=cmd_bench)

    s = sub.add_parser("summarize", help="mean ± sd of several bench reports (one per seed) per method")
    s.add_argument("reports", nargs="+", help="bench JSON files (python -m engine bench --json)")
    s.add_argument("--dataset", default="all", help="which dataset's figures (default: all pooled)")
    s.add_argument("--json", dest="json_out", help="write the summary to this JSON file")
    s.set_defaults(func=cmd_summarize)

    d = sub.add_parser("distill", help="train a draft for a target by self-distillation")
    add_distill_arguments(d)
    d.set_defaults(func=cmd_distill)

    c = sub.add_parser("costs", help="measure forward costs; model each benchmarked method's limit")
    add_costs_arguments(c)
    c.set_defaults(func=cmd_costs)

    h = sub.add_parser("train-hrad", help="collect H-RAD data on training prompts and train the classifier")
    add_model_arguments(h)
    add_sampling_arguments(h)
    add_hrad_arguments(h)
    h.set_defaults(func=cmd_train_hrad)

    gc = sub.add_parser("gpu-check", help="the whole device check in one call, each section under its own cap")
    gc.add_argument("--out", required=True, help="folder for results.json, each section's JSON and the trace")
    gc.add_argument("--dry-run", action="store_true", help="every section on the CPU with tiny shapes (CI runs it)")
    gc.add_argument("--sections", default="env,greedy,overlap,sanitizer,bench,krow", help="comma-separated subset")
    gc.set_defaults(func=cmd_gpu_check)
    return parser


def add_generate_arguments(g: argparse.ArgumentParser) -> None:
    add_model_arguments(g)
    add_sampling_arguments(g)
    g.add_argument("--method", default="specbranch", choices=METHODS, help="default: specbranch, as in the app")
    g.add_argument("--prompt")
    g.add_argument("--prompt-file", help="JSONL, one prompt per line in field 'prompt'")
    g.add_argument("--chat", action="store_true", help="wrap the prompt with the tokenizer's chat template")
    g.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    add_record_arguments(g)


def add_bench_arguments(b: argparse.ArgumentParser) -> None:
    add_model_arguments(b)
    add_sampling_arguments(b)
    b.add_argument(
        "--methods",
        default="ar,sd,pearl,specbranch",
        help="comma-separated; METHOD@DRAFT runs that method with another draft on the same target "
        "(e.g. ar,specbranch,specbranch@embedded,hf-assisted@embedded)",
    )
    b.add_argument(
        "--dataset",
        default="mt_bench",
        help="mt_bench | gsm8k | humaneval | all (the three) | PATH.jsonl; benchmark split only",
    )
    b.add_argument("--limit", type=int, default=10, help="prompts per dataset")
    b.add_argument("--json", dest="json_out", help="write the results to this JSON file")
    b.add_argument("--warmup", type=int, default=1, help="untimed warm-up generations per method")
    add_record_arguments(b)


def add_costs_arguments(c: argparse.ArgumentParser) -> None:
    add_model_arguments(c)
    c.add_argument("--bench", help="a bench JSON: add measured vs modelled speedup per method")
    c.add_argument(
        "--model-only",
        action="store_true",
        help="only model the --bench JSON: no model loads and no forward is measured",
    )
    c.add_argument("--context", type=int, default=200, help="tokens already in the cache")
    c.add_argument("--max-tokens", type=int, default=8, help="target forwards of 1..N tokens")
    c.add_argument("--max-rows", type=int, default=4, help="draft steps on 1..N rows")
    c.add_argument("--reps", type=int, default=15)
    c.add_argument("--json", dest="json_out")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        fill_model_defaults(args)
        args.func(args)
    except SpecBranchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0
