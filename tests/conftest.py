"""Shared fixtures: tiny random-weight Llama models (fast, small vocabulary) and the embedded pair."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# the drafts' default forward is lean-compiled (engine/presets.py); the suite's many tiny drafts run the lean path
# eager, as they did before that default, and test_lean.py compiles it where compiling is the point
os.environ["SPECBRANCH_DRAFT_FORWARD"] = "lean"
torch.set_num_threads(1)


class VerdictAt:
    """Stands in for the target's job where the draft asks whether the verdict has landed
    (parallel.draft_until_verdict):
    it has landed at the draft's `looks`-th look. The target's real pass runs beside the draft all the same."""

    def __init__(self, looks: int):
        self.looks = looks

    def done(self) -> bool:
        self.looks -= 1
        return self.looks < 0


def schedule_draft(monkeypatch, looks) -> None:
    """Make how many steps the draft of PEARL and SpecBranch takes beside each target pass a rule, not this machine's
    timing: 1 + looks(state) steps (at most the depth cap; fewer where the policy stops), where looks(state) is called
    once per round. A test whose figures depend on how far the draft drafts then gives the same figures on any
    machine, however busy. Patched through the module, so a test holds it for its own runs only (monkeypatch)."""
    from engine.methods import parallel

    real = parallel.draft_until_verdict

    async def draft_until_verdict(state, spec, ds, policy, target_job, events):
        await real(state, spec, ds, policy, VerdictAt(looks(state)), events)

    monkeypatch.setattr(parallel, "draft_until_verdict", draft_until_verdict)


def seeded_schedule(monkeypatch) -> None:
    """schedule_draft with each round's draft steps beside the target's pass, 1 to 2γ (as a machine's timing could
    make them), drawn from a generator seeded by the run's seed: every run is reproducible, and every depth is
    exercised."""

    def looks(state) -> int:
        return state.__dict__.setdefault("schedule", random.Random(state.cfg.seed)).randrange(2 * state.cfg.gamma)

    schedule_draft(monkeypatch, looks)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_app(engine, store, drafts: list[tuple[str, str]] | None = None, max_queue: int | None = None, **launch):
    """The app on `engine` (an Engine, or with `drafts` to pick from, a function from a draft spec to its Engine)
    recording to `store`, with the app's bounded queue (max_queue: its bound, default the app's), launched on a free
    local port: (demo, url)."""
    from app.main import SHOW_ERROR, bounded_queue, build_app

    demo = build_app(engine if drafts else lambda draft=None: engine, lambda: (store, ""), drafts=drafts)
    port = free_port()
    bounded_queue(demo, max_queue).launch(
        server_name="127.0.0.1",
        server_port=port,
        prevent_thread_lock=True,
        quiet=True,
        **{"show_error": SHOW_ERROR, **launch},
    )
    return demo, f"http://127.0.0.1:{port}/"


@pytest.fixture(scope="module")
def app_store(tmp_path_factory):
    """A fresh session store for one test module's app."""
    from sessions import Store

    with Store(tmp_path_factory.mktemp("db") / "sessions.db") as s:
        yield s


TINY_WORDS = ["<unk>", "<eos>", "a", "b", "c", "d", "e", "f", "g", "h"]


def tiny_tokenizer(words=TINY_WORDS):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


def make_tiny_model(
    path: Path,
    seed: int,
    vocab: int = len(TINY_WORDS),
    layers: int = 2,
    init: float = 0.3,
    context: int = 64,
    words=TINY_WORDS,
    eos: int | None = None,
    perturb: float = 0.0,
    perturb_seed: int = 0,
) -> Path:
    """A random-weight Llama saved as a transformers directory (loads like any local model).
    A large init makes its next-token distributions peaky enough for statistical tests to have power."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=context,
        initializer_range=init,
        tie_word_embeddings=False,
        eos_token_id=eos,
        bos_token_id=None,
        pad_token_id=None,
    )
    model = LlamaForCausalLM(config).eval()
    if perturb:  # a draft that resembles the target: same init, plus noise
        g = torch.Generator().manual_seed(perturb_seed)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g) * perturb * p.std().clamp_min(1e-3))
    model.generation_config.eos_token_id = eos
    model.save_pretrained(path)
    tiny_tokenizer(words[:vocab]).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {
        "target": make_tiny_model(root / "target", seed=1),
        "draft": make_tiny_model(root / "draft", seed=1, perturb=0.5, perturb_seed=2),
        "other_vocab": make_tiny_model(root / "other", seed=3, words=["<unk>", "<eos>"] + list("zyxwvuts")),
    }


@pytest.fixture(scope="session")
def tiny_engine(tiny_dirs):
    from engine.engine import Engine
    from engine.models.loading import load_pair

    # a float32 draft: the H-RAD tests compare its confidences with float32 references, and the tests that need
    # the draft ahead of the target rely on it being cheaper (a tiny model's bfloat16 casts cost more than its
    # matmuls); the bfloat16 draft has its own tests (tests/test_lm_head.py, tests/test_parallel_lossless.py)
    engine = Engine(load_pair(str(tiny_dirs["target"]), str(tiny_dirs["draft"]), device="cpu", draft_matmul="float32"))
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def embedded_target():
    from engine.models.loading import load_pair

    return load_pair("embedded", None, device="cpu")


# One prompt of each kind the benchmark has (chat, grade-school maths, code), and how far to decode them: the greedy
# equality tests of every method (test_greedy_equivalence.py, test_parallel_lossless.py) share these references,
# since transformers' generate() takes ~6 s a prompt here. 32 tokens a prompt hold 7-30 verdicts of each method
# with the often-wrong draft there: rejections, forks, rescues, holds and head starts, each asserted where it is tested
GREEDY_PROMPTS = [
    ("Explain why the sky is blue in two sentences.", True),
    (
        "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
        "How many clips did Natalia sell altogether in April and May?",
        True,
    ),
    ('def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n', False),
]
GREEDY_NEW = 32


@pytest.fixture(scope="session")
def embedded_reference_model():
    """The embedded target as transformers' own model, loaded apart from the engine's (reference.transformers_model:
    none of the engine's kernels run in it), from the directory the engine loads it from."""
    from engine.models.loading import resolve_source

    from .reference import transformers_model

    return transformers_model(resolve_source("embedded"))


@pytest.fixture(scope="session")
def greedy_references(embedded_target, request, tmp_path_factory):
    """[(prompt ids, the embedded target's own greedy generate() of GREEDY_NEW tokens)] for GREEDY_PROMPTS, from
    transformers' model loaded apart from the engine's (embedded_reference_model). Under xdist, once a run: the first
    worker to need them writes them to the run's own temporary folder, under a lock, and the others read them."""
    import json

    from filelock import FileLock

    from engine.engine import Engine

    from .reference import greedy_generate

    engine = Engine(embedded_target)  # its tokenizer and chat template only
    try:
        prompts = [engine.encode(text, chat) for text, chat in GREEDY_PROMPTS]
    finally:
        engine.close()

    def compute() -> list[list[int]]:
        model = request.getfixturevalue("embedded_reference_model")
        assert model is not embedded_target.target.model
        return [greedy_generate(model, ids, GREEDY_NEW) for ids in prompts]

    if os.environ.get("PYTEST_XDIST_WORKER") is None:  # one process: nothing to share
        return list(zip(prompts, compute()))
    shared = tmp_path_factory.getbasetemp().parent / f"greedy-references-{GREEDY_NEW}.json"  # this run's folder
    with FileLock(f"{shared}.lock"):
        if not shared.exists():
            shared.write_text(json.dumps({"prompts": prompts, "wants": compute()}))
        saved = json.loads(shared.read_text())
    assert saved["prompts"] == prompts
    return list(zip(prompts, saved["wants"]))


@pytest.fixture(scope="session")
def tiny_reference_model(tiny_dirs):
    """The tiny target as transformers' own model, loaded apart from the engine's (reference.transformers_model)."""
    from .reference import transformers_model

    return transformers_model(tiny_dirs["target"])


@pytest.fixture(scope="session")
def tiny_reference(tiny_reference_model):
    """greedy(prompt, new): the tiny target's greedy continuation (up to its context's end, where the engine stops
    too) from transformers' model loaded apart from the engine's (reference.transformers_model), memoised."""
    from .reference import greedy_generate

    model, memo = tiny_reference_model, {}

    def greedy(prompt: list[int], new: int) -> list[int]:
        new = min(new, model.config.max_position_embeddings - len(prompt))
        if (tuple(prompt), new) not in memo:
            memo[tuple(prompt), new] = greedy_generate(model, prompt, new)
        return memo[tuple(prompt), new]

    return greedy


def engine_with_draft(target_pair, draft_spec: str, matmul: str = "float32"):
    """An Engine on the already-loaded embedded target with another draft (no reload of the target); matmul: how
    the draft's matmuls read its weights (models.draft_matmul_kind)."""
    from engine.engine import Engine
    from engine.models.loading import with_draft

    return Engine(with_draft(target_pair.target, draft_spec, draft_matmul=matmul))


def bfloat16_refused_here(**load) -> bool:
    """On a CPU that runs no bfloat16 matmul natively, a bfloat16 draft is what a user gets there: a refusal that
    says why, asserted here through load_pair(**load, draft_matmul="bfloat16"); True then, and the caller's bfloat16
    case ends. False where the CPU runs bfloat16, and the caller tests the draft itself."""
    from engine.config import SpecBranchError
    from engine.kernels.lm_head import bf16_supported
    from engine.models.loading import load_pair

    if bf16_supported():
        return False
    with pytest.raises(SpecBranchError, match="needs a float32 draft on a CPU that runs bfloat16 natively"):
        load_pair(**load, device="cpu", draft_matmul="bfloat16")
    return True
