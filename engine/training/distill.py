"""`python -m engine distill`: train a small draft for any causal-LM target by self-distillation.

Three resumable stages, each writing into --work-dir:
  0. prompts   (optional, --self-prompts N) the target writes its own user questions (Magpie)
  1. generate  the target's own responses to training prompts (batched; skipped rows already done)
  2. label     the target's top-k next-token distribution at every response position (soft targets)
  3. train     a draft made of the target's first N layers, sharing its frozen embeddings and head,
               trained with KL(p_target || q_draft) over a reduced (FR-Spec) vocabulary
The draft is saved with `drafts.save_draft`, which `--draft PATH` loads.
"""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from engine.config import SpecBranchError, writable_dir
from engine.drafts.distilled import draft_from_target, grown, is_specbranch_draft, load_draft_dir, save_draft
from engine.training.common import (
    Checkpoint,
    DistillSpec,
    Optimiser,
    batches,
    capped_rows,
    frequent_vocab,
    held_out_split,
    read_jsonl,
)


def encode_prompt(tokenizer, row: dict) -> list[int]:
    if "prompt_ids" in row:
        return list(row["prompt_ids"])
    if "prompt" not in row:
        raise SpecBranchError("each prompt row needs a 'prompt' (text) or 'prompt_ids' field")
    if row.get("chat", True) and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": row["prompt"]}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        return list(ids["input_ids"] if isinstance(ids, dict) else ids)
    return tokenizer.encode(row["prompt"])


def stop_ids(target, tokenizer) -> set[int]:
    """Tokens that end a response: the tokenizer's eos and the model's generation eos (int or list)."""
    ids = {tokenizer.eos_token_id}
    eos = getattr(target.generation_config, "eos_token_id", None)
    ids |= set(eos) if isinstance(eos, (list, tuple)) else {eos}
    return {i for i in ids if i is not None}


@torch.inference_mode()
def generate_responses(
    target,
    tokenizer,
    prompts: list[dict],
    out: Path,
    max_new_tokens: int,
    batch_size: int,
    temperature: float,
    seed: int,
) -> None:
    """Append {prompt_ids, response_ids} rows to `out`; rows already there (by position) are skipped."""
    done = len(read_jsonl(out)) if out.exists() else 0
    stops = stop_ids(target, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(stops, default=0)
    torch.manual_seed(seed + done)
    with open(out, "a") as f, tqdm(total=len(prompts), initial=done, desc="generate", unit="prompt") as bar:
        for start in range(done, len(prompts), batch_size):
            batch = [encode_prompt(tokenizer, r) for r in prompts[start : start + batch_size]]
            width = max(map(len, batch))
            ids = torch.tensor([[pad] * (width - len(b)) + b for b in batch])  # left padding
            mask = torch.tensor([[0] * (width - len(b)) + [1] * len(b) for b in batch])
            kwargs = (
                dict(do_sample=True, temperature=temperature, top_p=0.95) if temperature > 0 else dict(do_sample=False)
            )
            gen = target.generate(
                input_ids=ids.to(target.device),
                attention_mask=mask.to(target.device),
                max_new_tokens=max_new_tokens,
                pad_token_id=pad,
                **kwargs,
            )[:, width:].tolist()
            for b, resp in zip(batch, gen):
                end = next((i for i, t in enumerate(resp) if t in stops), None)
                resp = resp if end is None else resp[: end + 1]  # keep the stop token: the draft learns to end
                f.write(json.dumps({"prompt_ids": b, "response_ids": resp}) + "\n")
            f.flush()
            bar.update(len(batch))


PLACEHOLDER = "\u2063QUESTION\u2063"


def pre_query_ids(tokenizer) -> tuple[list[int], int]:
    """The chat template up to where a user's words begin, and the token that ends a user turn."""
    if not getattr(tokenizer, "chat_template", None):
        raise SpecBranchError("--self-prompts needs a target whose tokenizer has a chat template")
    text = tokenizer.apply_chat_template([{"role": "user", "content": PLACEHOLDER}], tokenize=False)
    if PLACEHOLDER not in text:
        raise SpecBranchError("--self-prompts: the chat template does not place the user's words verbatim")
    before, after = text.split(PLACEHOLDER, 1)
    end_ids = tokenizer.encode(after.strip(), add_special_tokens=False)
    if not end_ids:
        raise SpecBranchError("--self-prompts: the chat template has no end-of-turn marker")
    return tokenizer.encode(before, add_special_tokens=False), end_ids[0]


def shingles(text: str, n: int = 8) -> set[tuple[str, ...]]:
    words = re.findall(r"\w+", text.lower())
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


@torch.inference_mode()
def generate_self_prompts(
    target,
    tokenizer,
    n: int,
    out: Path,
    batch_size: int,
    seed: int,
    exclude: set[tuple[str, ...]],
    max_new_tokens: int = 48,
    leads: tuple[str, ...] = (),
) -> None:
    """Magpie (Xu et al. 2024, arXiv 2406.08464): given only the template up to the user turn, an
    instruction-tuned target writes a user question. Sampled at T=1, top-p 0.95; kept when the turn
    ends within max_new_tokens, is new, and shares no 8-word run with a benchmark prompt (`exclude`,
    from `shingles`). Appends to `out`.

    `leads` opens each question with one of these words, row j of a round taking lead j mod len(leads): left to
    itself the 135M target writes mostly requests for advice ("Can you…", "I'm…", 70 % of its questions), and
    leads such as "Write" or "Summarize" ask it for the task-style instructions it rarely writes unprompted."""
    prefix, end_id = pre_query_ids(tokenizer)
    seen = {r["prompt"] for r in read_jsonl(out)} if out.exists() else set()
    # one row a question: [prefix + lead], left-padded to one width with end_id (masked out)
    openers = [tokenizer.encode(lead, add_special_tokens=False) for lead in leads] or [[]]
    rows = [prefix + openers[j % len(openers)] for j in range(batch_size)]
    width = max(map(len, rows))
    ids = torch.tensor([[end_id] * (width - len(r)) + r for r in rows], device=target.device)  # (batch, width)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=target.device)
    rounds = 0
    with open(out, "a") as f, tqdm(total=n, initial=len(seen), desc="self-prompts", unit="prompt") as bar:
        while len(seen) < n:
            torch.manual_seed(seed * 100_003 + len(seen) * 7 + rounds)  # resumable, yet new samples each round
            rounds += 1
            gen = target.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=True,
                temperature=1.0,
                top_p=0.95,
                max_new_tokens=max_new_tokens,
                eos_token_id=end_id,
                pad_token_id=end_id,
            )[:, width:].tolist()
            for j, resp in enumerate(gen):
                if end_id not in resp:
                    continue  # unfinished question
                opener = openers[j % len(openers)]  # decoded with its continuation, so the word's spacing holds
                text = tokenizer.decode(opener + resp[: resp.index(end_id)], skip_special_tokens=True).strip()
                if len(text) < 12 or text in seen or shingles(text) & exclude or len(seen) >= n:
                    continue
                seen.add(text)
                f.write(json.dumps({"prompt": text, "chat": True, "source": "self"}) + "\n")
                bar.update(1)
            f.flush()


def response_positions(rows: list[dict], chunk: list[int]) -> list[tuple[int, int, int]]:
    """(row in batch, first position, last position + 1) of the logits that predict response tokens."""
    out = []
    for b, i in enumerate(chunk):
        p, r = len(rows[i]["prompt_ids"]), len(rows[i]["response_ids"])
        out.append((b, p - 1, p - 1 + r))
    return out


@torch.inference_mode()
def label_topk(target, rows: list[dict], path: Path, k: int, batch_size: int) -> list[dict]:
    """Soft targets: for each row, top-k ids [R, k] and probs [R, k] of p at its response positions."""
    if path.exists():
        labels = torch.load(path)
        if len(labels) == len(rows):
            return labels
    labels: list[dict | None] = [None] * len(rows)
    for chunk, ids, mask in tqdm(list(batches(rows, batch_size, shuffle=False)), desc="label", unit="batch"):
        logits = target(input_ids=ids.to(target.device), attention_mask=mask.to(target.device)).logits.float()
        for b, lo, hi in response_positions(rows, chunk):
            probs, top = logits[b, lo:hi].softmax(-1).topk(k, dim=-1)
            labels[chunk[b]] = {"ids": top.to(torch.int32).cpu(), "probs": probs.half().cpu()}
    torch.save(labels, path)
    return labels


# ---------------------------------------------------------------- training
def draft_logits(draft, ids, mask, head: torch.Tensor) -> torch.Tensor:
    ids, mask = ids.to(head.device), mask.to(head.device)
    hidden = draft.model(input_ids=ids, attention_mask=mask).last_hidden_state  # [B, T, H]
    return hidden @ head.T  # [B, T, |subset|]


def kl_loss(logits_sub: torch.Tensor, rows, chunk, labels, remap: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """Cross-entropy of the draft against the teacher's top-k probs (renormalised over the subset);
    equals KL(p || q) up to the teacher's entropy. Also returns argmax agreements and positions."""
    losses, agree, total = [], 0, 0
    for b, lo, hi in response_positions(rows, chunk):
        logq = logits_sub[b, lo:hi].float().log_softmax(-1)  # [R, S]
        lab = labels[chunk[b]]
        sub_ids = remap[lab["ids"].long()].to(logq.device)  # position in the subset, -1 when outside
        p = lab["probs"].to(logq.device).float() * (sub_ids >= 0)
        p = p / p.sum(-1, keepdim=True).clamp_min(1e-8)
        losses.append(-(p * logq.gather(-1, sub_ids.clamp_min(0))).sum(-1))
        agree += int((logq.argmax(-1) == sub_ids[:, 0]).sum())
        total += hi - lo
    return torch.cat(losses).mean(), agree, total


def evaluate(draft, rows, labels, head, remap, batch_size) -> float:
    """Greedy agreement: how often the draft's argmax equals the target's argmax on held-out rows."""
    agree = total = 0
    draft.eval()
    with torch.inference_mode():
        for chunk, ids, mask in batches(rows, batch_size, shuffle=False):
            _, a, t = kl_loss(draft_logits(draft, ids, mask, head), rows, chunk, labels, remap)
            agree, total = agree + a, total + t
    draft.train()
    return agree / max(total, 1)


def reduced_head(target, rows: list[dict], vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(subset, remap, head): the FR-Spec vocabulary of `vocab` ids (frequent_vocab), each target id's position in
    it (-1 outside) [V], and the target's head rows of the subset [|subset|, H]."""
    vocab_size = target.get_output_embeddings().weight.shape[0]
    subset = frequent_vocab(rows, vocab, vocab_size)
    remap = torch.full((vocab_size,), -1, dtype=torch.long)
    remap[subset] = torch.arange(len(subset))
    head = target.get_output_embeddings().weight[subset].detach().contiguous()
    return subset, remap, head


@dataclass(frozen=True)
class DraftSettings:
    """How a standalone draft is trained (distill's flags)."""

    layers: int = 4
    vocab: int = 8192
    epochs: float = 3
    lr: float = 5e-4
    batch_size: int = 16
    seed: int = 0
    max_minutes: float | None = None  # stop after this long (wall clock, this run)
    init: Path | None = None
    grow: int = 0
    eval_every: int = 0  # steps between held-out evaluations besides each epoch's end (0: at epoch ends only)
    checkpoint_every: int = 100  # steps between checkpoints a rerun resumes from (0: none)
    stop_at: int = 0  # stop (checkpointed) at this step, for a rerun to go on from (0: run to the end)

    @classmethod
    def from_spec(cls, spec: DistillSpec) -> DraftSettings:
        return cls(
            layers=spec.layers,
            vocab=spec.vocab,
            epochs=spec.epochs,
            lr=spec.lr,
            batch_size=spec.batch_size,
            seed=spec.seed,
            max_minutes=spec.max_minutes,
            init=Path(spec.init) if spec.init else None,
            grow=spec.grow,
            eval_every=spec.eval_every,
        )

    def out_of_time(self, start: float, step: int) -> bool:
        return bool(
            (self.stop_at and step >= self.stop_at)
            or (self.max_minutes and time.time() - start > 60 * self.max_minutes)
        )


class DraftRun:
    """A standalone draft's training state: the draft, its reduced head, optimiser, schedule and the step reached,
    checkpointed (common.Checkpoint) so that a rerun of the same command resumes where it stopped."""

    def __init__(self, target, rows: list[dict], s: DraftSettings, work: Path):
        torch.manual_seed(s.seed)
        self.settings = s
        self.draft = initial_draft(target, s.layers, s.init, s.grow).train()
        for module in (self.draft.model.embed_tokens, self.draft.lm_head):  # shared with the target: frozen
            module.requires_grad_(False)
        self.subset, self.remap, self.head = reduced_head(target, rows, s.vocab)
        self.per_epoch = math.ceil(len(rows) / s.batch_size)
        self.total = max(1, int(s.epochs * self.per_epoch))
        params = [p for p in self.draft.parameters() if p.requires_grad]
        self.optimiser = Optimiser.warm_cosine(params, s.lr, self.total, warmup=20)
        self.ckpt = Checkpoint(work, "draft", s, rows, s.checkpoint_every)
        self.step, cpu_s = self.ckpt.restore(self.parts())
        self.cpu0 = time.process_time() - cpu_s

    def parts(self) -> dict:
        return {"draft": self.draft, "opt": self.optimiser.opt, "sched": self.optimiser.sched}

    def save(self) -> None:
        self.ckpt.save(self.parts(), self.step, time.process_time() - self.cpu0)

    def cpu_minutes(self) -> float:
        return round((time.process_time() - self.cpu0) / 60, 2)

    def train_step(self, rows, labels, chunk, ids, mask) -> tuple[float, float]:
        loss, agree, total = kl_loss(draft_logits(self.draft, ids, mask, self.head), rows, chunk, labels, self.remap)
        self.optimiser.step(loss)
        self.step += 1
        if self.ckpt.due(self.step):
            self.save()
        return loss.item(), agree / max(total, 1)

    def log(self, log, **fields) -> None:
        line = {"step": self.step, "epoch": round(self.step / self.per_epoch, 3), **fields}
        print(json.dumps({**line, "cpu_minutes": self.cpu_minutes()}), file=log, flush=True)


def train_draft(target, rows, labels, val_rows, val_labels, settings: DraftSettings, work: Path):
    """Train (or resume) a standalone draft on the teacher's labels of `rows`: (draft, its vocabulary subset, a
    summary). Logs to work/train_log.jsonl (appended to on a resume)."""
    s = settings
    run = DraftRun(target, rows, s, work)
    held_out = lambda: round(evaluate(run.draft, val_rows, val_labels, run.head, run.remap, s.batch_size), 4)  # noqa: E731
    with open(work / "train_log.jsonl", "a" if run.step else "w") as log:
        if not run.step:
            run.log(log, val_agreement=held_out())
        start, val = time.time(), None
        bar = tqdm(total=run.total, initial=run.step, desc="train", unit="step")
        while run.step < run.total and not s.out_of_time(start, run.step):
            epoch, skip = divmod(run.step, run.per_epoch)
            epoch_losses = []  # this run's part of the epoch
            for k, (chunk, ids, mask) in enumerate(batches(rows, s.batch_size, shuffle=True, seed=s.seed + epoch)):
                if k < skip:
                    continue  # taken before a resume
                loss, agree = run.train_step(rows, labels, chunk, ids, mask)
                epoch_losses.append(loss)
                bar.update(1)
                bar.set_postfix(loss=f"{loss:.3f}", agree=f"{agree:.3f}")
                if run.step % 25 == 0 or run.step == run.total:
                    run.log(log, loss=round(loss, 4), train_agreement=round(agree, 4), lr=run.optimiser.lr)
                end = run.step >= run.total or s.out_of_time(start, run.step) or run.step % run.per_epoch == 0
                if end or (s.eval_every and run.step % s.eval_every == 0):
                    val = held_out()
                    mean = round(sum(epoch_losses) / len(epoch_losses), 4)
                    run.log(log, val_agreement=val, **({"epoch_loss": mean} if run.step % run.per_epoch == 0 else {}))
                    tqdm.write(f"step {run.step}: held-out greedy agreement {val:.4f}")
                if end:
                    break
        bar.close()
    run.save()
    val = val if val is not None else held_out()
    return run.draft.eval(), run.subset, {"val_agreement": val, "steps": run.step, "cpu_minutes": run.cpu_minutes()}


def initial_draft(target, layers: int, init: Path | None, grow: int = 0):
    """The target's first `layers` layers, or (init) a saved draft to go on training (more data, more epochs), with
    `grow` layers added on top that start as no-ops (drafts.distilled.grown)."""
    device = next(target.parameters()).device
    if init is None:
        return draft_from_target(target, layers).to(device)
    draft, _ = load_draft_dir(init, target, torch.float32, device)  # its vocab subset is re-chosen from the rows
    return grown(draft, target, grow).to(device) if grow else draft


def check_inputs(spec: DistillSpec) -> None:
    """Fail fast, with the reason, on files that are missing or hold nothing to learn from."""
    for path in [*(spec.corpus or []), *([spec.prompts] if spec.prompts else [])]:
        if not Path(path).is_file():
            raise SpecBranchError(f"file not found: {path}")
        if not read_jsonl(Path(path)):
            raise SpecBranchError(f"{path} holds no rows (the file is empty)")
    if spec.kind == "head" and spec.unroll < 1:
        raise SpecBranchError(f"--unroll must be >= 1, got {spec.unroll}")
    if spec.kind != "head" and spec.feature_layers:
        raise SpecBranchError("--feature-layers is for --kind head")
    if spec.kind == "head" and spec.hard_labels:
        raise SpecBranchError("--hard-labels is for a standalone draft (a head's labels come with its features)")
    if spec.held_out and not Path(spec.held_out).is_file():
        raise SpecBranchError(f"file not found: {spec.held_out}")
    if spec.init and spec.kind == "head":
        raise SpecBranchError("--init continues a standalone draft; a head starts from the target's last layer")
    if spec.grow and not spec.init:
        raise SpecBranchError("--grow adds layers to the draft --init names")
    if spec.init and not is_specbranch_draft(Path(spec.init)):
        raise SpecBranchError(
            f"--init {spec.init}: not a draft directory (no config.json with a specbranch_draft entry)"
        )
    if not (spec.corpus or spec.prompts or spec.self_prompts):
        raise SpecBranchError("distill needs training data: give --corpus, --prompts or --self-prompts")
    if spec.self_prompt_leads and not spec.self_prompts:
        raise SpecBranchError("--self-prompt-leads opens the target's own questions: give --self-prompts N too")


def self_prompted_rows(spec: DistillSpec, target, tok, work: Path) -> list[dict]:
    """The target's answers to questions it wrote itself (--self-prompts), none near a benchmark prompt."""
    from engine.measure.datasets import DATASETS, benchmark_prompts

    exclude = set().union(*(shingles(p.text) for d in DATASETS for p in benchmark_prompts(d)))
    prompt_file, generated = work / "self_prompts.jsonl", work / "self_generated.jsonl"
    size, leads = spec.gen_batch_size, spec.self_prompt_leads or ()
    generate_self_prompts(target, tok, spec.self_prompts, prompt_file, size, spec.seed, exclude, leads=leads)
    prompts = read_jsonl(prompt_file)[: spec.self_prompts]
    generate_responses(
        target, tok, prompts, generated, spec.max_new_tokens, spec.gen_batch_size, spec.gen_temperature, spec.seed
    )
    return read_jsonl(generated)[: spec.self_prompts]


def distill_rows(spec: DistillSpec, target, tok, work: Path) -> list[dict]:
    """The (prompt, response) rows to learn from, those with a response: the corpora's, then the target's answers
    to --prompts and to --self-prompts (generated into the work folder, resumably)."""
    rows: list[dict] = []
    for corpus in spec.corpus or []:
        rows += [{"prompt_ids": r["prompt_ids"], "response_ids": r["response_ids"]} for r in read_jsonl(Path(corpus))]
    if spec.prompts:
        generated = work / "generated.jsonl"
        prompts = read_jsonl(Path(spec.prompts))[: spec.limit or None]
        generate_responses(
            target, tok, prompts, generated, spec.max_new_tokens, spec.gen_batch_size, spec.gen_temperature, spec.seed
        )
        rows += read_jsonl(generated)
    if spec.self_prompts:
        rows += self_prompted_rows(spec, target, tok, work)
    return [r for r in rows if r["response_ids"]]


def run_distill(spec: DistillSpec) -> dict:
    """`python -m engine distill`: the rows, then a standalone draft or a head trained on them."""
    from engine.models.loading import load_pair

    check_inputs(spec)
    work = writable_dir(Path(spec.work_dir), "work files")
    writable_dir(Path(spec.out), "draft")
    torch.set_num_threads(spec.threads) if spec.threads else None
    pair = load_pair(spec.target, None, device=spec.device, dtype="float32")
    target, tok = pair.target.model, pair.target.tokenizer
    target.requires_grad_(False)
    rows = distill_rows(spec, target, tok, work)
    if spec.generate_only:
        print(f"distill: generated; {len(rows)} rows, {sum(len(r['response_ids']) for r in rows)} response tokens")
        return {"rows": len(rows)}
    if len(rows) < 2:
        raise SpecBranchError(
            "distill needs at least two (prompt, response) rows: give --corpus, --prompts or --self-prompts"
        )
    if spec.kind == "head":
        from engine.training.head_distill import run_head_distill

        deepest = target.config.num_hidden_layers
        if spec.feature_layers and max(spec.feature_layers) > deepest:
            raise SpecBranchError(f"--feature-layers: the target has hidden states 0..{deepest}")

        return run_head_distill(spec, target, rows, work)
    return distill_standalone(spec, target, rows, work)


def hard_labels(rows: list[dict]) -> list[dict]:
    """Each response token as a label of probability 1, in label_topk's form: the target's own answers are its
    greedy (or sampled) tokens, so no target pass is needed (a sampled token is an unbiased draw of p)."""
    return [
        {
            "ids": torch.tensor(r["response_ids"], dtype=torch.int32)[:, None],
            "probs": torch.ones(len(r["response_ids"]), 1, dtype=torch.float16),
        }
        for r in rows
    ]


def draft_labels(spec: DistillSpec, target, train_rows, val_rows, work: Path) -> tuple[list[dict], list[dict]]:
    """(training labels, held-out labels): the target's top-k at every response position, or with --hard-labels the
    answers' own tokens for training (the held-out rows keep the target's top-k: agreement is with its argmax)."""
    if spec.hard_labels:
        path = work / f"labels_top{spec.top_k}_val_{len(val_rows)}_{spec.seed}.pt"
        return hard_labels(train_rows), label_topk(target, val_rows, path, spec.top_k, spec.label_batch_size)
    path = work / f"labels_top{spec.top_k}_{len(train_rows) + len(val_rows)}_{spec.seed}.pt"
    labels = label_topk(target, train_rows + val_rows, path, spec.top_k, spec.label_batch_size)
    return labels[: len(train_rows)], labels[len(train_rows) :]


def distill_standalone(spec: DistillSpec, target, rows: list[dict], work: Path) -> dict:
    """Stages label and train for a standalone draft; saves it to spec.out with its card's facts."""
    train_rows, val_rows = held_out_split(rows, spec.held_out, spec.val_fraction, spec.seed)
    train_labels, val_labels = draft_labels(spec, target, train_rows, val_rows, work)
    if spec.max_tokens:  # a data-size curve: fewer training rows, the same held-out rows and labels
        kept = capped_rows(train_rows, spec.max_tokens, spec.seed)
        train_rows, train_labels = [train_rows[i] for i in kept], [train_labels[i] for i in kept]
    n_tokens = sum(len(r["response_ids"]) for r in train_rows)
    print(f"distill: {len(train_rows)} training rows ({n_tokens} response tokens), {len(val_rows)} held-out rows")
    settings = DraftSettings.from_spec(spec)
    draft, subset, summary = train_draft(target, train_rows, train_labels, val_rows, val_labels, settings, work)
    meta = {
        "target": spec.target,
        "layers": draft.config.num_hidden_layers,
        "init": spec.init,
        "grow": spec.grow,
        "vocab_subset_size": int(len(subset)),
        "train_rows": len(train_rows),
        "train_response_tokens": n_tokens,
        "held_out_rows": len(val_rows),
        **spec.training_meta(),
        "top_k_labels": spec.top_k,
        "hard_labels": spec.hard_labels,
        **summary,
    }
    use_subset = spec.vocab < target.get_output_embeddings().weight.shape[0]
    save_draft(draft, Path(spec.out), subset if use_subset else None, meta)
    (Path(spec.out) / "training_log.jsonl").write_text((work / "train_log.jsonl").read_text())
    print(json.dumps(meta))
    return meta
