"""`python -m engine gpu-check --out DIR`: the whole device check in one call (docs/gpu.md).

Each section runs in a process of its own (`python -m engine.measure.gpu_check --section NAME`), under its own time
cap, and writes DIR/NAME.json; the driver merges them into DIR/results.json after each one, so a section that
crashes or runs out of time costs only itself, and what ran is kept. Sections:
  env        versions, the device, its clocks and memory as read
  greedy     ar, sd, pearl and specbranch against transformers' generate() on the real pair, in float32, then
             bfloat16; each divergence with its first index and the float32 top-2 logit margin there
  overlap    a target step beside a draft step through the engine's own workers, on two streams, on one shared
             stream, and one after the other: efficiency = (t_target + t_draft) / t_both; a torch.profiler trace
             of a few SpecBranch rounds
  sanitizer  a short pearl and specbranch run under TORCH_CUDA_SANITIZER=1 (stream races)
  bench      ar, sd, pearl, specbranch and hf-assisted on the real pair, then on synthetic 1B- and 7B-shaped Llama
             targets with truncated drafts (random weights: timing only, never acceptance); ratios against `ar` of
             the same run
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

SECTIONS = ("env", "greedy", "overlap", "sanitizer", "bench", "krow")
CAPS_S = {"env": 30, "greedy": 120, "overlap": 75, "sanitizer": 60, "bench": 150, "krow": 75}  # 8.5 min: one call
DRY_CAPS_S = {"env": 45, "greedy": 90, "overlap": 75, "sanitizer": 30, "bench": 90, "krow": 60}  # < 5 min
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

    def __setitem__(self, key, value) -> None:
        super().__setitem__(key, value)
        if self.path is not None:
            write_json(self.path, {"status": "partial", "result": dict(self)})


@dataclass
class Setup:
    """What a section runs on: the real pair's device and dtype, or tiny CPU stand-ins for the dry run."""

    dry: bool
    device: str
    prompts: int
    new_tokens: int

    @classmethod
    def of(cls, dry: bool) -> Setup:
        if dry:
            return cls(True, "cpu", 2, 8)
        return cls(False, "cuda" if torch.cuda.is_available() else "cpu", 4, 64)


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


def config(method: str, new_tokens: int, **extra):
    from engine.config import GenerationConfig

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


def greedy_in(setup: Setup, dtype: str, out: Saved, margin_model=None):
    """Each method's greedy output against generate() in `dtype` (into out[dtype], row by row); margins read from
    margin_model (float32). Returns the target's model."""
    from engine.engine import Engine

    pair = real_pair(setup, dtype)
    engine = Engine(pair)
    rows, identical = [], 0
    for ids in prompt_ids(engine, setup.prompts):
        ref = reference(pair.target.model, ids, setup.new_tokens, pair.eos_ids)
        for method in ("ar", "sd", "pearl", "specbranch"):
            ours = engine.run(ids, config(method, setup.new_tokens)).token_ids
            at = first_divergence(ours, ref)
            row = {"method": method, "prompt_tokens": len(ids), "tokens": len(ours), "identical": at is None}
            if at is not None:
                model = margin_model if margin_model is not None else pair.target.model
                row.update(first_index=at, margin_fp32=top2_margin(model, ids + ref[:at]))
            identical += at is None
            rows.append(row)
            out[dtype] = {"dtype": dtype, "identical": identical, "runs": len(rows), "rows": rows}
    return pair.target.model


def section_greedy(setup: Setup, out: Saved) -> dict:
    model = greedy_in(setup, "float32", out)
    if not setup.dry:  # the dry run's tiny CPU pair has no bfloat16 kernels worth checking
        greedy_in(setup, "bfloat16", out, margin_model=model)
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


def overlap_arrangements(pair, steps: int, cache_len: int = 128) -> dict:
    """t_target, t_draft alone; both at once on two streams and on one shared stream; and one after the other."""
    import asyncio

    from engine.runtime import Worker, new_event_loop

    loop = new_event_loop()
    run = loop.run_until_complete

    def workers(shared: bool):
        t = Worker("target", 1, pair.target.device)
        d = Worker("draft", 1, pair.draft.device)
        if shared:
            d.stream = t.stream  # both workers' forwards queue on one CUDA stream
        return t, d

    t, d = workers(False)
    run(step_loop(t, pair.target, cache_len, 2)())  # warm-up: kernels load, caches allocate
    run(step_loop(d, pair.draft, cache_len, 2)())
    alone_t = busy_s(run(step_loop(t, pair.target, cache_len, steps)()))
    alone_d = busy_s(run(step_loop(d, pair.draft, cache_len, steps)()))
    out = {"steps": steps, "t_target_s": round(alone_t, 6), "t_draft_s": round(alone_d, 6)}
    for name, shared in (("two_streams", False), ("shared_stream", True)):
        t, d = workers(shared)

        async def both(t=t, d=d):
            return await asyncio.gather(
                step_loop(t, pair.target, cache_len, steps)(), step_loop(d, pair.draft, cache_len, steps)()
            )

        spans = [s for group in run(both()) for s in group]
        out[name] = {
            "t_both_s": round(busy_s(spans), 6),
            "efficiency": round((alone_t + alone_d) / max(busy_s(spans), 1e-9), 4),
        }
    t, d = workers(False)
    one_after = busy_s(run(step_loop(t, pair.target, cache_len, steps)())) + busy_s(
        run(step_loop(d, pair.draft, cache_len, steps)())
    )
    out["sequential"] = {"t_both_s": round(one_after, 6), "efficiency": round((alone_t + alone_d) / one_after, 4)}
    loop.close()
    return out


def section_overlap(setup: Setup, result: Saved, out_dir: Path) -> dict:
    from engine.engine import Engine

    pair = real_pair(setup, "bfloat16" if not setup.dry else "float32")
    result["real_pair"] = overlap_arrangements(pair, 8 if setup.dry else 32)
    if not setup.dry:
        for key in ("1b", "7b"):
            result[key] = overlap_arrangements(
                synthetic_pair(SHAPES[key], setup.device, torch.bfloat16, tokenizer()), 16
            )
            torch.cuda.empty_cache()
    engine = Engine(pair)
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
    """pearl and specbranch under torch's CUDA sanitizer, each in a process of its own (it hooks CUDA at import)."""
    for method in ("pearl", "specbranch"):
        argv = [
            sys.executable,
            "-m",
            "engine",
            "generate",
            "--method",
            method,
            "--prompt",
            "Explain a hash map.",
            "--chat",
            "--max-new-tokens",
            "16",
            "--draft-worker",
            "thread",
        ]
        if setup.dry:
            out[method] = {"skipped": "the CUDA sanitizer has nothing to check on the CPU"}
            continue
        # the workers' streams are what races; a compiled target's CUDA graphs are left out of this run
        argv += ["--device", setup.device, "--draft", "embedded", "--target-forward", "transformers"]
        env = dict(os.environ, TORCH_CUDA_SANITIZER="1")
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=25, env=env)
        except subprocess.TimeoutExpired:
            out[method] = {"timeout_s": 25}
            continue
        races = proc.stderr.count("CSAN detected a possible data race")
        out[method] = {"exit": proc.returncode, "races": races, "stderr_tail": proc.stderr[-1500:]}
    return out


def bench_engines(entries, setup: Setup, label: str) -> dict:
    """ar and the speculative methods on the same prompts, interleaved per prompt (the bench's own loop); each
    ratio is against the `ar` of this run. entries: (label, engine, method, draft spec), each method with its draft's
    preset (engine/presets.py), as `python -m engine bench` runs it."""
    from engine.config import BASELINE
    from engine.measure.bench import BenchSpec, run_bench
    from engine.presets import config_for

    given = {"max_new_tokens": setup.new_tokens}  # as `bench --max-new-tokens N`: the rest from each draft's preset
    spec = BenchSpec(settings=config_for(BASELINE, "embedded", given), dataset="all", limit=1, warmup=1)
    report = run_bench([(name, eng, config_for(m, draft, given).validate()) for name, eng, m, draft in entries], spec)
    keys = (
        "tokens_per_s",
        "speedup_vs_ar",
        "acceptance_rate",
        "mean_accepted_length",
        "overlap",
        "target_forward_ms",
        "draft_forward_ms",
    )
    return {
        "label": label,
        "identical_to_ar": report["identical_to_ar"],
        "summary": {m: {k: per["all"].get(k) for k in keys} for m, per in report["results"].items()},
        "report": report,
    }


def section_bench(setup: Setup, out: Saved) -> dict:
    from engine.engine import Engine
    from engine.models.loading import with_draft

    methods = ("ar", "sd", "pearl", "specbranch", "hf-assisted")
    if setup.dry:
        pair = real_pair(setup, "float32")
        engine = Engine(pair)
        out["real_pair"] = bench_engines(
            [(m, engine, m, "embedded") for m in methods], setup, "tiny stand-in for the real pair"
        )
        return out
    pair = real_pair(setup, "bfloat16", draft="embedded")
    engines = {"embedded": Engine(pair)}
    for draft in ("embedded-head", "self-skip:4,5,6,7"):
        engines[draft] = Engine(with_draft(pair.target, draft))
    entries = [(m, engines["embedded"], m, "embedded") for m in methods]
    entries += [
        (f"{m}@{d}", engines[d], m, d)
        for d in ("embedded-head", "self-skip:4,5,6,7")
        for m in ("sd", "pearl", "specbranch")
    ]
    out["real_pair"] = bench_engines(entries, setup, "embedded target, bf16")
    tok = tokenizer()
    for key in ("1b", "7b"):
        engine = Engine(synthetic_pair(SHAPES[key], setup.device, torch.bfloat16, tok))
        out[key] = bench_engines(
            [(m, engine, m, "embedded") for m in methods], setup, SHAPES[key].name + " (random weights)"
        )
        del engine
        torch.cuda.empty_cache()
    return out


def krow_costs(pair, context: int, reps: int, rounds: int) -> dict:
    """A draft step on 1..4 rows and the target's step fed 1..8 tokens, each alone (costs.measure); and the target's
    one-token step while the draft steps on k rows beside it (Engine.branch_costs: what a fork's rows cost it)."""
    import dataclasses

    from engine.engine import Engine
    from engine.measure.costs import measure

    engine = Engine(pair)  # every forward through the engine's own workers, on their streams
    try:
        out = measure(engine, context=context, max_tokens=8, max_rows=4, reps=reps)
        out["target_beside_draft_rows"] = dataclasses.asdict(engine.branch_costs(4, rounds=rounds))
    finally:
        engine.close()
    return out


def section_krow(setup: Setup, out: Saved) -> dict:
    if setup.dry:
        out["real_pair"] = krow_costs(real_pair(setup, "float32"), 32, reps=2, rounds=1)
        return out
    out["real_pair"] = krow_costs(real_pair(setup, "bfloat16"), 256, reps=15, rounds=3)
    tok = tokenizer()
    for key in ("1b", "7b"):
        out[key] = krow_costs(synthetic_pair(SHAPES[key], setup.device, torch.bfloat16, tok), 256, reps=15, rounds=3)
        torch.cuda.empty_cache()
    return out


def run_section(name: str, setup: Setup, out_dir: Path) -> dict:
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
    return dict(sections[name](setup, out))


# ------------------------------------------------------------------ driver
def write_json(path: Path, data) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    tmp.replace(path)


def section_main(name: str, out_dir: Path, dry: bool) -> int:
    """One section in this process: its result, or its error, into out_dir/NAME.json."""
    started = time.perf_counter()
    try:
        result, status = run_section(name, Setup.of(dry), out_dir), "ok"
    except Exception as exc:  # noqa: BLE001 - a section's failure is its result, the check goes on
        result, status = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-4000:]}, "error"
    write_json(
        out_dir / f"{name}.json",
        {"status": status, "seconds": round(time.perf_counter() - started, 1), "result": result},
    )
    return 0


def run_check(
    out_dir: Path,
    dry: bool = False,
    sections: tuple[str, ...] = SECTIONS,
    log=print,
    caps: dict[str, float] | None = None,
) -> dict:
    """Every section in a process of its own under its cap (caps: seconds by section, default CAPS_S, or DRY_CAPS_S
    for the dry run); results.json rewritten after each one."""
    out_dir.mkdir(parents=True, exist_ok=True)
    caps = caps or (DRY_CAPS_S if dry else CAPS_S)
    results = {"dry_run": dry, "started": time.strftime("%Y-%m-%d %H:%M:%S"), "sections": {}}
    for name in sections:
        argv = [sys.executable, "-m", "engine.measure.gpu_check", "--section", name, "--out", str(out_dir)]
        argv += ["--dry-run"] if dry else []
        started = time.perf_counter()
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=caps[name])
            part = out_dir / f"{name}.json"
            done = (
                json.loads(part.read_text())
                if part.exists()
                else {"status": "error", "result": {"error": f"exit {proc.returncode}", "stderr": proc.stderr[-3000:]}}
            )
            part.unlink(missing_ok=True)  # results.json holds it: few files to bring back from a device
        except subprocess.TimeoutExpired:
            part = out_dir / f"{name}.json"
            kept = json.loads(part.read_text())["result"] if part.exists() else {}
            part.unlink(missing_ok=True)
            done = {"status": "timeout", "result": {"error": f"over its cap of {caps[name]} s", "kept": kept}}
        done["seconds"] = round(time.perf_counter() - started, 1)
        results["sections"][name] = done
        write_json(out_dir / "results.json", results)
        log(f"gpu-check {name}: {done['status']} ({done['seconds']} s)")
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.measure.gpu_check")
    p.add_argument("--section", required=True, choices=SECTIONS)
    p.add_argument("--out", required=True)
    p.add_argument("--dry-run", action="store_true")
    args = p.parse_args(argv)
    return section_main(args.section, Path(args.out), args.dry_run)


if __name__ == "__main__":
    sys.exit(main())
