"""`python -m engine gpu-check --out DIR`: the whole device check in one call of at most BUDGET_S (docs/gpu.md).

Each section runs in a process of its own (`python -m engine.measure.gpu_check --section NAME`), under its own time
cap and what is left of the budget, and writes DIR/NAME.json item by item as it goes; the driver merges them into
DIR/results.json after each one, so a section that crashes or runs out of time costs only itself, and what ran is
kept. A compile that failed (or a section that ran out of time while compiling) is not paid for again: the sections
after it run their models eager (--no-compile), and results.json says so. Sections:
  env        versions, the device, its clocks and memory as read
  greedy     ar, sd, pearl and specbranch against transformers' generate() on the real pair, loaded once: in float32
             (eager), then in bfloat16 (a cast copy, compiled as a run on a GPU is); each divergence with its first
             index and the float32 top-2 logit margin there
  overlap    a target step beside a draft step through the engine's workers, on two streams, on one shared
             stream, and one after the other: efficiency = (t_target + t_draft) / t_both; a torch.profiler trace
             of a few SpecBranch rounds
  sanitizer  a short pearl and specbranch run under TORCH_CUDA_SANITIZER=1 (stream races), on the main thread and
             the workers' threads (the threads it checked are listed)
  bench      ar, sd, pearl, specbranch and hf-assisted on the real pair, then on synthetic 1B- and 7B-shaped Llama
             targets with truncated drafts (random weights: timing only, never acceptance); ratios against `ar` of
             the same run; each run saved as it ends
  krow       a draft step on 1..4 rows, and the target's step alone and beside it, for each target
--dry-run runs every section on the CPU with tiny shapes, so CI proves the check itself works.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.config import GenerationConfig

SECTIONS = ("env", "greedy", "overlap", "sanitizer", "bench", "krow")
CAPS_S = {"env": 20, "greedy": 100, "overlap": 70, "sanitizer": 50, "bench": 140, "krow": 70}
BUDGET_S = 450  # the whole check: 7.5 min, with the install before it one device call (scripts/device_carry.py)
DRY_CAPS_S = {"env": 45, "greedy": 90, "overlap": 75, "sanitizer": 30, "bench": 90, "krow": 60}
DRY_BUDGET_S = 360
MIN_LEFT_S = 5  # a section is not started with less of the budget left
VOCAB = 49152  # the embedded target's vocabulary: synthetic targets share its tokenizer


@dataclass(frozen=True)
class Shape:
    """A Llama target's shape (synthetic: random weights, timing only)."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    draft_layers: int  # its truncated draft


SHAPES = {
    "1b": Shape("synthetic-1b", 2048, 16, 32, 8, 8192, 2),
    "7b": Shape("synthetic-7b", 4096, 32, 32, 32, 11008, 2),
}
TINY = Shape("synthetic-tiny", 64, 4, 4, 2, 128, 1)


class Saved(dict):
    """A section's result, written to its file at every item set: a section stopped at its cap keeps what it did."""

    def __init__(self, path: Path | None):
        super().__init__()
        self.path = path
        self.engines = []  # the engines the section made (engine_on): not saved

    def __setitem__(self, key, value) -> None:
        super().__setitem__(key, value)
        if self.path is not None:
            write_json(self.path, {"status": "partial", "result": dict(self)})


@dataclass
class Setup:
    """What a section runs on: the real pair's device and dtype, or tiny CPU stand-ins for the dry run; compile:
    whether its engines compile their steps (not after a compile that failed in an earlier section)."""

    dry: bool
    device: str
    prompts: int
    new_tokens: int
    compile: bool = True

    @classmethod
    def of(cls, dry: bool, compile: bool = True) -> Setup:
        if dry:
            return cls(True, "cpu", 2, 8, compile)
        return cls(False, "cuda" if torch.cuda.is_available() else "cpu", 4, 64, compile)


def engine_on(pair, setup: Setup, out: Saved, compile: bool | None = None):
    """An Engine on `pair`, compiling its models' steps where the setup allows it (and `compile` does not say no).
    out["compiling"] is true while it compiles, so that a section stopped then tells the driver; the engine is kept
    in out.engines, whose compile failures section_main reports."""
    from engine.engine import Engine

    wanted = setup.compile if compile is None else compile and setup.compile
    out["compiling"] = wanted
    engine = Engine(pair, compile=wanted)
    out.engines.append(engine)
    out["compiling"] = False
    return engine


def compile_failures(engines) -> dict[str, str]:
    """Why each model that was to run compiled runs eager, by model name (none where every compile held)."""
    return {lm.name: lm.compile_why for e in engines for lm in (e.pair.target, e.pair.draft) if lm and lm.compile_why}


# ------------------------------------------------------------------ models
def tokenizer():
    """The embedded target's tokenizer (vocabulary 49,152), which synthetic targets share."""
    from transformers import AutoTokenizer

    from engine.models.loading import resolve_source

    return AutoTokenizer.from_pretrained(resolve_source("embedded"))


def synthetic_llama(shape: Shape, device: str, dtype: torch.dtype, seed: int = 0):
    """A Llama of `shape` with random weights, built on `device` (no host copy of a 7B model), cast to `dtype`
    with the rotary tables kept float32."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine.models.devices import cast_model

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=shape.hidden,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        intermediate_size=shape.intermediate,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = 2
    return cast_model(model, dtype=dtype).eval()


def synthetic_pair(shape: Shape, device: str, dtype: torch.dtype, tok):
    """A synthetic target and its truncated draft (its first draft_layers layers) as the engine's ModelPair."""
    from engine.drafts.distilled import draft_from_target
    from engine.models.devices import cast_model
    from engine.models.loading import LM, pair_of

    model = synthetic_llama(shape, device, dtype)
    target = LM(shape.name, model, tok, VOCAB)
    with torch.device(device):  # built where it runs: no host copy of the draft's layers
        draft = cast_model(draft_from_target(model, shape.draft_layers), device, dtype)
    return pair_of(target, f"truncated:{shape.draft_layers}", draft, tok, None)


def real_pair(setup: Setup, dtype: str, draft: str = "embedded"):
    """The embedded target and a shipped draft on the check's device (tiny stand-ins in the dry run)."""
    from engine.models.loading import load_pair

    if setup.dry:
        return synthetic_pair(TINY, "cpu", torch.float32, tokenizer())
    return load_pair("embedded", draft, device=setup.device, dtype=dtype, draft_worker="thread")


def prompt_ids(engine, n: int) -> list[list[int]]:
    """n benchmark-split prompts (chat ones first), as token ids."""
    from engine.measure.datasets import benchmark_prompts

    prompts = benchmark_prompts("mt_bench", n) + benchmark_prompts("humaneval", n)
    return [engine.encode(p.text, p.chat) for p in prompts[:n]]


def config(method: str, new_tokens: int, **extra) -> GenerationConfig:
    return GenerationConfig(method=method, max_new_tokens=new_tokens, temperature=0.0, **extra).validate()


# ------------------------------------------------------------------ sections
def section_env(setup: Setup, out: Saved) -> dict:
    import transformers

    out.update(
        python=platform.python_version(),
        torch=torch.__version__,
        transformers=transformers.__version__,
        cuda_available=torch.cuda.is_available(),
        device=setup.device,
        dry_run=setup.dry,
    )
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        out.update(
            gpu=props.name,
            capability=f"{props.major}.{props.minor}",
            multiprocessors=props.multi_processor_count,
            memory_gib=round(props.total_memory / 2**30, 1),
            cuda=torch.version.cuda,
        )
        query = "name,driver_version,clocks.sm,clocks.mem,clocks.max.sm,power.draw,temperature.gpu,memory.used"
        try:
            smi = subprocess.run(
                ["nvidia-smi", f"--query-gpu={query}", "--format=csv"], capture_output=True, text=True, timeout=20
            )
            out["nvidia_smi"] = smi.stdout.strip()
        except (OSError, subprocess.TimeoutExpired) as exc:
            out["nvidia_smi"] = f"not read: {exc}"
    return out


def first_divergence(ours: list[int], ref: list[int]) -> int | None:
    """The first index where two token lists differ (a length difference counts), or None."""
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            return i
    return None if len(ours) == len(ref) else min(len(ours), len(ref))


@torch.inference_mode()
def top2_margin(model, ids: list[int]) -> float:
    """The float32 gap between the two largest next-token logits after `ids`: a near-tie, where kernels summing in
    another order may pick the other token."""
    logits = model(torch.tensor([ids], device=next(model.parameters()).device)).logits[0, -1].float()
    top = logits.topk(2).values
    return round(float(top[0] - top[1]), 6)


@torch.inference_mode()
def reference(model, ids: list[int], new_tokens: int, eos: set[int]) -> list[int]:
    """transformers' own greedy continuation of ids."""
    device = next(model.parameters()).device
    out = model.generate(
        torch.tensor([ids], device=device),
        max_new_tokens=new_tokens,
        do_sample=False,
        eos_token_id=sorted(eos),
        pad_token_id=sorted(eos)[0],
    )
    return out[0, len(ids) :].tolist()


def greedy_in(setup: Setup, pair, dtype: str, out: Saved, margin_model, compile: bool) -> None:
    """Each method's greedy output on `pair` against generate() (into out[dtype], row by row); margins read from
    margin_model (float32)."""
    engine = engine_on(pair, setup, out, compile)
    rows, identical = [], 0
    try:
        for ids in prompt_ids(engine, setup.prompts):
            ref = reference(pair.target.model, ids, setup.new_tokens, pair.eos_ids)
            for method in ("ar", "sd", "pearl", "specbranch"):
                ours = engine.run(ids, config(method, setup.new_tokens)).token_ids
                at = first_divergence(ours, ref)
                row = {"method": method, "prompt_tokens": len(ids), "tokens": len(ours), "identical": at is None}
                if at is not None:
                    row.update(first_index=at, margin_fp32=top2_margin(margin_model, ids + ref[:at]))
                identical += at is None
                rows.append(row)
                out[dtype] = {"dtype": dtype, "compiled": compile and setup.compile, "identical": identical,
                              "runs": len(rows), "rows": rows}  # fmt: skip
    finally:
        engine.close()


def cast_pair(pair, dtype: torch.dtype):
    """A copy of a loaded pair's target cast to `dtype`, with the pair's draft (by its spec) on it: the same weights,
    read from disk once (the draft is small, and a distilled one borrows the copy's head). The CPU's packed layouts
    (lm_head.fast_linears) do not copy: a target on a GPU, or loaded without them."""
    import copy

    from engine.models.devices import cast_model
    from engine.models.loading import LM, static_target, with_draft

    t = pair.target
    model = cast_model(copy.deepcopy(t.model), dtype=dtype).eval()
    target = LM(t.name, model, t.tokenizer, t.vocab_size, static=static_target(model, "static"))
    return with_draft(target, pair.draft.name)


def section_greedy(setup: Setup, out: Saved) -> dict:
    """The pair loaded once: float32 eager (the engine's arithmetic against generate()'s, no compile in between),
    then a bfloat16 copy compiled as a run on a GPU is. On a CPU (the dry run's tiny pair) there are no bfloat16
    kernels worth checking."""
    pair = real_pair(setup, "float32")
    greedy_in(setup, pair, "float32", out, pair.target.model, compile=False)
    if setup.device.startswith("cuda"):
        greedy_in(setup, cast_pair(pair, torch.bfloat16), "bfloat16", out, pair.target.model, compile=True)
    return out


def step_loop(worker, lm, cache_len: int, steps: int, rows: int = 1):
    """An async job: `steps` one-token forwards of `lm` on `rows` rows through `worker`, after a prefill of cache_len
    tokens; returns their TimingSpans (CUDA events on a GPU)."""
    from engine.runtime import settled

    async def job():
        cache = lm.new_cache()
        ids = torch.randint(0, lm.vocab_size, (1, cache_len))
        await worker.run(lm.forward, ids, cache, kind="prefill", step=0, t0=0.0)
        if rows > 1:
            cache.batch_repeat_interleave(rows)
        spans = []
        for i in range(steps):
            x = torch.randint(0, lm.vocab_size, (rows, 1))
            _, span = await worker.run(lm.forward, x, cache, kind="decode", step=i + 1, t0=0.0, tokens=rows)
            spans.append(span)
        return [settled(s) for s in spans]  # read from their CUDA events once all are queued

    return job


def busy_s(spans) -> float:
    return max(s.end for s in spans) - min(s.start for s in spans)


def overlap_arrangements(engine, steps: int, cache_len: int = 128) -> dict:
    """t_target, t_draft alone; both at once on two streams and on one shared stream; and one after the other:
    through the engine's own workers, whose threads its models' steps compiled on."""
    import asyncio

    from engine.runtime import new_event_loop

    loop = new_event_loop()
    run = loop.run_until_complete
    pair, t, d = engine.pair, engine.target_worker, engine.draft_worker
    own = d.stream
    try:
        run(step_loop(t, pair.target, cache_len, 2)())  # warm-up: kernels load, caches allocate
        run(step_loop(d, pair.draft, cache_len, 2)())
        alone_t = busy_s(run(step_loop(t, pair.target, cache_len, steps)()))
        alone_d = busy_s(run(step_loop(d, pair.draft, cache_len, steps)()))
        out = {"steps": steps, "t_target_s": round(alone_t, 6), "t_draft_s": round(alone_d, 6)}
        for name, shared in (("two_streams", False), ("shared_stream", True)):
            d.stream = t.stream if shared else own  # both workers' forwards queue on one CUDA stream

            async def both():
                return await asyncio.gather(
                    step_loop(t, pair.target, cache_len, steps)(), step_loop(d, pair.draft, cache_len, steps)()
                )

            spans = [s for group in run(both()) for s in group]
            out[name] = {
                "t_both_s": round(busy_s(spans), 6),
                "efficiency": round((alone_t + alone_d) / max(busy_s(spans), 1e-9), 4),
            }
        d.stream = own
        one_after = busy_s(run(step_loop(t, pair.target, cache_len, steps)())) + busy_s(
            run(step_loop(d, pair.draft, cache_len, steps)())
        )
        out["sequential"] = {"t_both_s": round(one_after, 6), "efficiency": round((alone_t + alone_d) / one_after, 4)}
    finally:
        d.stream = own
        loop.close()
    return out


def section_overlap(setup: Setup, result: Saved, out_dir: Path) -> dict:
    pair = real_pair(setup, "bfloat16" if not setup.dry else "float32")
    engine = engine_on(pair, setup, result)
    result["real_pair"] = overlap_arrangements(engine, 8 if setup.dry else 32)
    if not setup.dry:
        for key in ("1b", "7b"):
            synthetic = engine_on(synthetic_pair(SHAPES[key], setup.device, torch.bfloat16, tokenizer()), setup, result)
            try:
                result[key] = overlap_arrangements(synthetic, 16)
            finally:
                synthetic.close()
            torch.cuda.empty_cache()
    ids = prompt_ids(engine, 1)[0]
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available() and not setup.dry:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    engine.run(ids, config("specbranch", 8))  # warm-up outside the trace
    with torch.profiler.profile(activities=activities) as prof:
        run = engine.run(ids, config("specbranch", 16 if not setup.dry else 6))
    trace = out_dir / "specbranch-trace.json.gz"  # Perfetto opens it gzipped
    prof.export_chrome_trace(str(trace))
    result["trace"] = {
        "file": trace.name,
        "bytes": trace.stat().st_size,
        "steps": sum(1 for e in run.events if e.type == "step_started"),
    }
    return result


def section_sanitizer(setup: Setup, out: Saved) -> dict:
    """pearl and specbranch under torch's CUDA sanitizer, each in a process of its own (it hooks CUDA at import).
    Its dispatch mode is per thread, and the forwards run on the workers' threads: runtime enters it on each worker
    thread too, and each run lists the threads it checked, so that "races: 0" says what it covered."""
    for method in ("pearl", "specbranch"):
        if setup.dry:
            out[method] = {"skipped": "the CUDA sanitizer has nothing to check on the CPU"}
            continue
        argv = [sys.executable, "-m", "engine.measure.gpu_check", "--sanitized-run", method, "--out", "-"]
        env = dict(os.environ, TORCH_CUDA_SANITIZER="1")
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=25, env=env)
        except subprocess.TimeoutExpired:
            out[method] = {"timeout_s": 25}
            continue
        lines = proc.stdout.strip().splitlines()
        ran = json.loads(lines[-1]) if proc.returncode == 0 and lines else {}
        out[method] = {
            "exit": proc.returncode,
            "races": proc.stderr.count("CSAN detected a possible data race"),
            "threads_checked": ran.get("threads_checked", []),
            "tokens": ran.get("tokens"),
            "stderr_tail": proc.stderr[-1500:],
        }
    return out


def sanitized_run(method: str) -> dict:
    """One short run of `method` on the real pair (the target on transformers' forward, the draft eager: no CUDA
    graphs, whose replays the sanitizer does not see), on its engine's workers; run under TORCH_CUDA_SANITIZER=1.
    Returns the threads the sanitizer's mode was entered on (runtime.sanitized_threads) and the tokens made."""
    from engine.engine import Engine
    from engine.models.loading import load_pair
    from engine.runtime import sanitized_threads

    pair = load_pair("embedded", "embedded", device="cuda", target_forward="transformers", draft_worker="thread")
    engine = Engine(pair, compile=False)
    try:
        ids = engine.encode("Explain a hash map.", chat=True)
        tokens = len(engine.run(ids, config(method, 16)).token_ids)
    finally:
        engine.close()
    return {"threads_checked": ["main"] + sanitized_threads(), "tokens": tokens}


BENCH_KEYS = (
    "tokens_per_s",
    "speedup_vs_ar",
    "acceptance_rate",
    "mean_accepted_length",
    "overlap",
    "target_forward_ms",
    "draft_forward_ms",
)


class EntryLog:
    """run_bench's log (start, another, finish: what sessions.SessionLog does to record a bench), here to save each
    entry's run the moment it ends: its label, its prompt and its figures, under out[key]["runs"]; a bench stopped
    at its cap keeps every run it finished."""

    def __init__(self, out: Saved, key: str, labels: list[str]):
        self.out, self.key, self.labels, self.rows, self.prompt, self.next = out, key, labels, [], -1, 0

    def start(self, prompt: str, cfg) -> RunEvents:
        """A prompt's first entry."""
        self.prompt, self.next = self.prompt + 1, 0
        return RunEvents()

    def another(self) -> RunEvents:
        """The prompt's next entry."""
        return RunEvents()

    def finish(self, recorder: RunEvents) -> None:
        finished = [e for e in recorder.events if e.type == "finished"]
        metrics = finished[-1].metrics if finished else {}
        row = {"label": self.labels[self.next], "prompt": self.prompt, "finished": bool(finished)}
        self.rows.append({**row, **{k: metrics.get(k) for k in BENCH_KEYS if k in metrics}})
        self.next += 1
        self.out[self.key] = {"runs": self.rows}


class RunEvents:
    """One run's events, as run_bench hands them to its log's recorder (Recorder.add)."""

    def __init__(self):
        self.events = []

    def add(self, event) -> None:
        self.events.append(event)


def bench_engines(entries, setup: Setup, label: str, out: Saved, key: str) -> dict:
    """ar and the speculative methods on the same prompts, interleaved per prompt (the bench's own loop); each
    ratio is against the `ar` of this run. entries: (label, engine, method, draft spec), each method with its draft's
    preset (engine/presets.py), as `python -m engine bench` runs it. Each run is saved to out[key] as it ends, and
    the whole report there at the end."""
    from engine.config import BASELINE
    from engine.measure.bench import BenchSpec, run_bench
    from engine.presets import config_for

    given = {"max_new_tokens": setup.new_tokens}  # as `bench --max-new-tokens N`: the rest from each draft's preset
    spec = BenchSpec(settings=config_for(BASELINE, "embedded", given), dataset="all", limit=1, warmup=1)
    log = EntryLog(out, key, [name for name, _, _, _ in entries])
    report = run_bench(
        [(name, eng, config_for(m, draft, given).validate()) for name, eng, m, draft in entries], spec, log
    )
    out[key] = {
        "label": label,
        "identical_to_ar": report["identical_to_ar"],
        "summary": {m: {k: per["all"].get(k) for k in BENCH_KEYS} for m, per in report["results"].items()},
        "runs": log.rows,
        "report": report,
    }
    return out[key]


def section_bench(setup: Setup, out: Saved) -> dict:
    from engine.models.loading import with_draft

    methods = ("ar", "sd", "pearl", "specbranch", "hf-assisted")
    if setup.dry:
        engine = engine_on(real_pair(setup, "float32"), setup, out)
        bench_engines([(m, engine, m, "embedded") for m in methods], setup, "tiny stand-in for the real pair", out,
                      "real_pair")  # fmt: skip
        return out
    pair = real_pair(setup, "bfloat16", draft="embedded")
    engines = {"embedded": engine_on(pair, setup, out)}
    for draft in ("embedded-head", "self-skip:4,5,6,7"):
        engines[draft] = engine_on(with_draft(pair.target, draft), setup, out)
    entries = [(m, engines["embedded"], m, "embedded") for m in methods]
    entries += [
        (f"{m}@{d}", engines[d], m, d)
        for d in ("embedded-head", "self-skip:4,5,6,7")
        for m in ("sd", "pearl", "specbranch")
    ]
    bench_engines(entries, setup, "embedded target, bf16", out, "real_pair")
    tok = tokenizer()
    for key in ("1b", "7b"):
        engine = engine_on(synthetic_pair(SHAPES[key], setup.device, torch.bfloat16, tok), setup, out)
        bench_engines([(m, engine, m, "embedded") for m in methods], setup, SHAPES[key].name + " (random weights)",
                      out, key)  # fmt: skip
        engine.close()
        torch.cuda.empty_cache()
    return out


def krow_costs(engine, context: int, reps: int, rounds: int) -> dict:
    """A draft step on 1..4 rows and the target's step fed 1..8 tokens, each alone (costs.measure); and the target's
    one-token step while the draft steps on k rows beside it (Engine.branch_costs: what a fork's rows cost it), every
    forward through the engine's own workers, on their streams."""
    import dataclasses

    from engine.measure.costs import measure

    try:
        out = measure(engine, context=context, max_tokens=8, max_rows=4, reps=reps)
        out["target_beside_draft_rows"] = dataclasses.asdict(engine.branch_costs(4, rounds=rounds))
    finally:
        engine.close()
    return out


def section_krow(setup: Setup, out: Saved) -> dict:
    if setup.dry:
        out["real_pair"] = krow_costs(engine_on(real_pair(setup, "float32"), setup, out), 32, reps=2, rounds=1)
        return out
    out["real_pair"] = krow_costs(engine_on(real_pair(setup, "bfloat16"), setup, out), 256, reps=15, rounds=3)
    tok = tokenizer()
    for key in ("1b", "7b"):
        engine = engine_on(synthetic_pair(SHAPES[key], setup.device, torch.bfloat16, tok), setup, out)
        out[key] = krow_costs(engine, 256, reps=15, rounds=3)
        torch.cuda.empty_cache()
    return out


def run_section(name: str, setup: Setup, out_dir: Path) -> Saved:
    """The section `name`, its result saved item by item to out_dir/NAME.json as it goes."""
    out = Saved(out_dir / f"{name}.json")
    sections = {
        "env": section_env,
        "greedy": section_greedy,
        "sanitizer": section_sanitizer,
        "bench": section_bench,
        "krow": section_krow,
        "overlap": lambda setup, out: section_overlap(setup, out, out_dir),
    }
    if name not in sections:
        raise ValueError(f"unknown section {name!r}")
    sections[name](setup, out)
    return out


# ------------------------------------------------------------------ driver
def write_json(path: Path, data) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    tmp.replace(path)


def section_main(name: str, out_dir: Path, dry: bool, compile: bool = True) -> int:
    """One section in this process: its result, or its error, into out_dir/NAME.json, with the compiles that failed
    in it (compile_failed), which the driver does not pay for again."""
    started = time.perf_counter()
    try:
        out = run_section(name, Setup.of(dry, compile), out_dir)
        result, status = dict(out), "ok"
        failed = compile_failures(out.engines)
        if failed:
            result["compile_failed"] = failed
    except Exception as exc:  # noqa: BLE001 - a section's failure is its result, the check goes on
        result, status = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-4000:]}, "error"
    write_json(
        out_dir / f"{name}.json",
        {"status": status, "seconds": round(time.perf_counter() - started, 1), "result": result},
    )
    return 0


def run_one(name: str, out_dir: Path, dry: bool, compile: bool, cap: float) -> dict:
    """One section in a process of its own, stopped at `cap` seconds: its result, what it kept if stopped."""
    argv = [sys.executable, "-m", "engine.measure.gpu_check", "--section", name, "--out", str(out_dir)]
    argv += (["--dry-run"] if dry else []) + ([] if compile else ["--no-compile"])
    part = out_dir / f"{name}.json"
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=cap)
        done = (
            json.loads(part.read_text())
            if part.exists()
            else {"status": "error", "result": {"error": f"exit {proc.returncode}", "stderr": proc.stderr[-3000:]}}
        )
    except subprocess.TimeoutExpired:
        kept = json.loads(part.read_text())["result"] if part.exists() else {}
        done = {"status": "timeout", "result": {"error": f"over its cap of {cap:.0f} s", "kept": kept}}
    part.unlink(missing_ok=True)  # results.json holds it: few files to bring back from a device
    return done


def section_cap(cap: float, left: float) -> float | None:
    """A section's time: its own cap, at most what is left of the check's budget; None (not started) when under
    MIN_LEFT_S is left, too little for a process to import torch."""
    return None if left < MIN_LEFT_S else min(cap, left)


def compile_trouble(done: dict) -> str:
    """Why the sections after this one should not compile: a compile that failed in it, or its stop mid-compile."""
    result = done["result"]
    if result.get("compile_failed"):
        return "; ".join(f"{name}: {why}" for name, why in result["compile_failed"].items())
    if done["status"] == "timeout" and result.get("kept", {}).get("compiling"):
        return "it ran out of time while compiling"
    return ""


def run_check(
    out_dir: Path,
    dry: bool = False,
    sections: tuple[str, ...] = SECTIONS,
    log=print,
    caps: dict[str, float] | None = None,
    budget_s: float | None = None,
) -> dict:
    """Every section in a process of its own under its cap and what is left of the budget (caps: seconds by section,
    default CAPS_S, or DRY_CAPS_S for the dry run; budget_s: BUDGET_S or DRY_BUDGET_S); results.json rewritten after
    each one. After a compile that failed, the later sections run eager (results.json's compile_skipped says why)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    caps = caps or (DRY_CAPS_S if dry else CAPS_S)
    deadline = time.perf_counter() + (budget_s or (DRY_BUDGET_S if dry else BUDGET_S))
    results = {"dry_run": dry, "started": time.strftime("%Y-%m-%d %H:%M:%S"), "sections": {}}
    compile = True
    for name in sections:
        started, cap = time.perf_counter(), section_cap(caps[name], deadline - time.perf_counter())
        if cap is None:
            done = {"status": "skipped", "result": {"error": "no time left in the check's budget"}}
        else:
            done = run_one(name, out_dir, dry, compile, cap)
        done["seconds"] = round(time.perf_counter() - started, 1)
        results["sections"][name] = done
        why = compile_trouble(done) if compile else ""
        if why:
            compile, results["compile_skipped"] = False, {"after": name, "why": why}
        write_json(out_dir / "results.json", results)
        log(f"gpu-check {name}: {done['status']} ({done['seconds']} s)")
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.measure.gpu_check")
    p.add_argument("--section", choices=SECTIONS)
    p.add_argument("--sanitized-run", choices=("pearl", "specbranch"), help="one run, for the sanitizer section")
    p.add_argument("--out", required=True)
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--no-compile", action="store_true", help="the models' steps eager (a compile failed before)")
    args = p.parse_args(argv)
    if args.sanitized_run:
        print(json.dumps(sanitized_run(args.sanitized_run)))
        return 0
    if not args.section:
        p.error("--section or --sanitized-run is required")
    return section_main(args.section, Path(args.out), args.dry_run, compile=not args.no_compile)


if __name__ == "__main__":
    sys.exit(main())
