"""The command line, `python -m engine generate | bench | summarize | costs | distill | train-hrad`: every
argument is defined here, once (docs/cli.md)."""

from __future__ import annotations

import argparse
import json
import sys

from engine.config import (
    DRAFT_FORWARDS,
    DRAFT_MATMULS,
    DRAFT_WORKERS,
    METHODS,
    TARGET_FORWARDS,
    GenerationConfig,
    SpecBranchError,
    config_from,
    writable_file,
)

MAX_THREADS = 1024


def thread_count(text: str) -> int:
    """A torch thread count for argparse: an integer from 0 to MAX_THREADS (torch.set_num_threads overflowed past
    2**31 with a traceback)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if not 0 <= value <= MAX_THREADS:
        raise argparse.ArgumentTypeError(f"must be from 0 to {MAX_THREADS}, got {value}")
    return value


def layer_list(text: str) -> tuple[int, ...]:
    """Hidden-state indices for argparse: "2,15,27" -> (2, 15, 27), each >= 0, no repeats (the target's depth is
    checked once it is loaded)."""
    try:
        layers = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of layer indices: {text!r}") from None
    if any(i < 0 for i in layers) or len(set(layers)) != len(layers):
        raise argparse.ArgumentTypeError(f"layer indices must be >= 0 and distinct, got {text!r}")
    return layers


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="embedded", help="embedded | PATH.gguf | DIR | hub id")
    p.add_argument(
        "--draft",
        default=None,
        help="embedded | embedded-weak | self | self-skip:I,J,... | truncated:N | PATH.gguf | DIR | hub id "
        "(default: the fastest this machine supports, engine/presets.py default_draft: self on a CPU "
        "with the int4 kernel, else embedded). The draft's preset sets every generation setting not "
        "given as a flag",
    )
    p.add_argument("--device", default=None, help="cuda, cuda:0, cpu (default: cuda when present)")
    p.add_argument("--draft-device", default=None)
    p.add_argument("--dtype", default=None, help="float32 (CPU default) | bfloat16 (CUDA default) | float16")
    p.add_argument(
        "--draft-matmul",
        default="auto",
        choices=DRAFT_MATMULS,
        help="how the draft's matmuls read its weights: bfloat16 (half float32's memory traffic), int4 "
        "(an eighth; with --draft self, the target's own weights as a cheap draft) or float32; "
        "auto: int4 for --draft self on a CPU, else bfloat16 where the CPU runs it natively. Output "
        "stays exact: only the target decides it",
    )
    p.add_argument(
        "--draft-forward",
        default=None,
        choices=DRAFT_FORWARDS,
        help="lean: a Llama draft on the CPU runs engine/lean.py (fused matmuls, a KV cache that rolls "
        "back by a pointer); lean-compiled: that, with its one-token steps through torch.compile "
        "(compiled at load: ~40 s the first time, a C++ compiler needed, else eager with a note); "
        "transformers: the model's own forward (default: lean-compiled, or $SPECBRANCH_DRAFT_FORWARD)",
    )
    p.add_argument(
        "--target-forward",
        default="static",
        choices=TARGET_FORWARDS,
        help="static: a Llama target on the CPU runs engine/static_forward.py (transformers' ops, with "
        "q/k/v and gate/up each one stacked matmul, over a KV cache written in place: the same bits, "
        "checked at load, and a faster step); transformers: the model's own forward",
    )
    p.add_argument(
        "--draft-worker",
        default="process",
        choices=DRAFT_WORKERS,
        help="process: a draft on the CPU runs its forwards in a child process of its own (the models no "
        "longer take turns at one Python interpreter; the child loads the same draft and its logits "
        "are checked bit for bit at start); thread: on a thread of this process",
    )
    p.add_argument("--threads", type=thread_count, default=1, help="torch threads per model worker")
    p.add_argument(
        "--solo-threads",
        type=thread_count,
        default=None,
        help="torch threads for a draft step the target waits on (SD's draft block, a parallel method's "
        "head start), when the draft has the cores to itself (default: the cores available, at most 2; "
        "1 turns it off)",
    )
    p.add_argument("--trust-remote-code", action="store_true")


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
    p.add_argument("--branches", type=int, default=3, help="specbranch: most candidates at a branch point")
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
        "confidence (engine/calibration.py; the default)",
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


# the settings a draft's preset gives where no flag does (engine/presets.py Preset's fields)
PRESET_FIELDS = ("gamma", "epsilon", "draft_stop", "feed_stop", "head_start", "hold", "hold_branches", "hrad")


def apply_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """Fill what no flag gave, in place: the draft (the fastest this machine supports), the draft's forward, and the
    generation settings from the draft's preset. `args.flags` keeps the settings given as flags, so that another
    draft's preset can fill the rest (with_preset)."""
    from engine.presets import default_draft, draft_forward

    if getattr(args, "draft", "none") is None:
        args.draft = default_draft(args.device)
    if getattr(args, "draft_forward", "set") is None:
        args.draft_forward = draft_forward()
    if hasattr(args, "gamma"):
        args.flags = {k: getattr(args, k) for k in PRESET_FIELDS if getattr(args, k) is not None}
        vars(args).update(with_preset(args, args.draft).__dict__)
    return args


def with_preset(args: argparse.Namespace, draft: str | None) -> argparse.Namespace:
    """A copy of the arguments whose generation settings are `draft`'s preset, where no flag gave them."""
    from engine.presets import preset_for

    return argparse.Namespace(**{**vars(args), **preset_for(draft).settings(), **args.flags})


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The parsed command line, with every default filled (apply_defaults)."""
    return apply_defaults(build_parser().parse_args(argv))


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


class SessionLog:
    """Records CLI runs: one session per prompt, one run per method. Never stops a generation:
    if the store cannot be used, it says so once and the runs go on unrecorded."""

    def __init__(self, args, engine):
        self.enabled, self.args, self.engine, self.store = bool(args.record), args, engine, None
        if self.enabled:
            from sessions import SessionStoreError, Store

            try:
                self.store = Store(args.db)
            except SessionStoreError as exc:
                print(f"warning: not recording: {exc}", file=sys.stderr)

    def start(self, prompt: str, cfg: GenerationConfig):
        if self.store is None:
            return None
        from sessions import SessionStoreError

        pair = self.engine.pair
        try:
            sid = self.store.start_session(
                "cli", prompt, pair.target.name, pair.draft.name if pair.draft else None, cfg, shared=self.args.share
            )
        except SessionStoreError as exc:
            print(f"warning: not recording: {exc}", file=sys.stderr)
            return None
        return sid

    def recorder(self, sid):
        return None if sid is None else self.store.recorder(sid)

    @staticmethod
    def finish(recorder) -> None:
        if recorder is not None and recorder.close():
            print(f"warning: not recording: {recorder.error}", file=sys.stderr)


def build_engine(args, need_draft: bool):
    import torch

    from engine.engine import Engine
    from engine.models.loading import draft_matmul_kind, is_self_draft, load_pair, pick_device, pick_dtype

    if args.solo_threads is not None and args.solo_threads < 1:
        raise SpecBranchError(f"--solo-threads must be at least 1, got {args.solo_threads}")
    for device in (args.device, args.draft_device):  # refuse an unusable device before loading anything
        pick_device(device)
    if need_draft:  # and a draft matmul this machine cannot run
        ddev = pick_device(args.draft_device or args.device)
        draft_matmul_kind(args.draft_matmul, ddev, pick_dtype(args.dtype, ddev), is_self_draft(args.draft))
    torch.set_num_threads(max(1, args.threads))
    pair = load_pair(
        args.target,
        args.draft if need_draft else None,
        device=args.device,
        draft_device=args.draft_device,
        dtype=args.dtype,
        trust_remote_code=args.trust_remote_code,
        draft_matmul=args.draft_matmul,
        draft_forward=args.draft_forward,
        target_forward=args.target_forward,
        draft_worker=args.draft_worker,
    )
    if pair.draft_worker_why:
        print(f"note: the draft runs in this process: {pair.draft_worker_why}", file=sys.stderr)
    if pair.draft is not None and pair.draft.compile_why:
        print(f"note: the draft's steps run eager, not compiled: {pair.draft.compile_why}", file=sys.stderr)
    return Engine(pair, threads=max(1, args.threads), solo_threads=args.solo_threads)


def cmd_generate(args) -> None:
    from pathlib import Path

    from engine.training.common import read_jsonl

    cfg = config_from(args, args.method)
    if args.prompt is None and args.prompt_file is None:
        raise SpecBranchError("give --prompt TEXT or --prompt-file F.jsonl")
    prompts = (
        [args.prompt] if args.prompt is not None else [r.get("prompt", "") for r in read_jsonl(Path(args.prompt_file))]
    )
    engine = build_engine(args, need_draft=args.method != "ar")
    log = SessionLog(args, engine)
    for prompt in prompts:
        ids = engine.encode(prompt, args.chat)
        recorder = log.recorder(log.start(prompt, cfg))
        try:
            result = engine.run(ids, cfg, prompt, on_event=recorder.add if recorder else None)
        finally:
            log.finish(recorder)
        for e in result.events:
            if e.type == "notice":
                print(f"{e.level}: {e.message}", file=sys.stderr)
        record = {
            "method": result.method,
            "token_ids": result.token_ids,
            "text": result.text,
            "finish_reason": result.finish_reason,
            "metrics": result.metrics,
        }
        if args.json:
            print(json.dumps(record), flush=True)
        else:
            print(result.text)
            m = result.metrics
            print(
                f"[{result.method}] {m['new_tokens']} tokens, {m['tokens_per_s']} tok/s, "
                f"acceptance {m['acceptance_rate']}, tokens/target forward {m['mean_accepted_length']}, "
                f"path rollback {m['path_rollback_rate']}, wasted draft {m['wasted_draft_rate']}",
                file=sys.stderr,
            )


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
    from engine.engine import Engine
    from engine.measure.bench import run_bench
    from engine.models.loading import with_draft

    entries = parse_bench_methods(args.methods)
    # each entry's settings: its draft's preset where no flag gave them; validated before any model loads
    configs = {label: config_from(with_preset(args, draft or args.draft), method) for label, method, draft in entries}
    writable_file(args.json_out, "bench results")
    engine = build_engine(args, need_draft=any(m != "ar" and d is None for _, m, d in entries))
    engines = {None: engine}
    t = engine.pair.target
    for draft in sorted({d for _, _, d in entries if d is not None}):  # other drafts share the loaded target
        engines[draft] = Engine(
            with_draft(
                t,
                draft,
                trust_remote_code=args.trust_remote_code,
                draft_matmul=args.draft_matmul,
                draft_forward=args.draft_forward,
                draft_worker=args.draft_worker,
            ),
            threads=max(1, args.threads),
            solo_threads=args.solo_threads,
        )
    run_bench([(label, engines[d], configs[label]) for label, _, d in entries], args, SessionLog(args, engine))


def cmd_summarize(args) -> None:
    from engine.measure.bench import run_summary

    run_summary(args)


def cmd_train_hrad(args) -> None:
    from engine.training.hrad import run_train_hrad

    config_from(args, "specbranch")
    args.build_engine = lambda a: build_engine(a, need_draft=True)
    run_train_hrad(args)


def cmd_costs(args) -> None:
    from engine.measure.bench import read_report
    from engine.measure.costs import run_costs

    writable_file(args.json_out, "costs")
    if args.model_only and not args.bench:
        raise SpecBranchError("--model-only models a bench JSON: name one with --bench")
    report = read_report(args.bench) if args.bench else None  # refused before any model loads
    engine = None if args.model_only else build_engine(args, need_draft=args.draft != "none")
    run_costs(engine, args, report)


def cmd_distill(args) -> None:
    from engine.training.distill import run_distill

    run_distill(args)


def cmd_gpu_check(args) -> None:
    from pathlib import Path

    from engine.measure.gpu_check import SECTIONS, run_check

    sections = tuple(s.strip() for s in args.sections.split(",") if s.strip())
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown or not sections:
        raise SpecBranchError(
            f"--sections: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(SECTIONS)}"
        )
    out = Path(args.out)
    writable_file(str(out / "results.json"), "the device check's results")
    results = run_check(out, args.dry_run, sections)
    failed = [name for name, s in results["sections"].items() if s["status"] != "ok"]
    print(f"wrote {out / 'results.json'}" + (f"; not ok: {', '.join(failed)}" if failed else "; every section ok"))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m engine", description="SpecBranch Studio engine")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text with one method")
    add_model_arguments(g)
    add_sampling_arguments(g)
    g.add_argument("--method", default="specbranch", choices=METHODS, help="default: specbranch, as in the app")
    g.add_argument("--prompt")
    g.add_argument("--prompt-file", help="JSONL, one prompt per line in field 'prompt'")
    g.add_argument("--chat", action="store_true", help="wrap the prompt with the tokenizer's chat template")
    g.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    add_record_arguments(g)
    g.set_defaults(func=cmd_generate)

    b = sub.add_parser("bench", help="compare methods on a dataset")
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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        apply_defaults(args)
        args.func(args)
    except SpecBranchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0
