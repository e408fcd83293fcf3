"""Issue 11, what can be checked without a GPU: the span arithmetic of the CUDA timing path, the CUDA worker's
order of stream operations and what waits on what (against fake streams and events, not a GPU), the CPU worker
unchanged and free of device-wide syncs, unusable devices refused before any model loads, an out-of-memory forward
ending only its own run, and the distill paths taking their device. Nothing here runs CUDA kernels."""

from __future__ import annotations

import asyncio
import json
import threading
from contextlib import nullcontext

import pytest
import torch

from engine import runtime
from engine.cli import main
from engine.config import GenerationConfig, SpecBranchError
from engine.engine import Engine
from engine.models.loading import LM, load_pair, pick_device
from engine.runtime import OutOfMemory, Worker, span_seconds

from .conftest import make_tiny_model


# ---------------------------------------------------------------- span arithmetic
def test_span_seconds_from_fake_elapsed_times():
    # reference ran 0.25 s after t0; the forward's kernels ran 12 ms to 15.5 ms after it
    assert span_seconds(0.25, 12.0, 15.5) == (0.262, 0.2655)
    assert span_seconds(0.0, 0.0, 0.0) == (0.0, 0.0)
    # sub-microsecond values round to the TimingSpan resolution (1 us)
    assert span_seconds(1.0, 0.0004, 1.0006) == (1.0, 1.001001)
    # an end event that reads earlier than its start (timer jitter) never makes a negative span
    start, end = span_seconds(0.5, 3.0, 2.9)
    assert start == end == 0.503


# ---------------------------------------------------------------- the CUDA worker, against fakes
class FakeCuda:
    """Just enough of torch.cuda for Worker: a fake GPU clock in ms that `fn` advances, and a log of
    every stream/event operation in order."""

    def __init__(self):
        self.now_ms = 100.0
        self.log: list[tuple] = []
        self.streams_made = 0
        cuda = self

        class Event:
            def __init__(self, enable_timing=False):
                self.timing, self.t = enable_timing, None

            def record(self, stream):
                self.t = cuda.now_ms
                cuda.log.append(("record", stream.name, self.timing))

            def synchronize(self):
                cuda.log.append(("event_sync",))

            def query(self):
                return True

            def elapsed_time(self, other):
                assert self.timing and other.timing, "elapsed_time needs timing events"
                return other.t - self.t

        class Stream:
            def __init__(self, device=None, name="worker"):
                self.device, self.name = device, name
                cuda.streams_made += 1

            def wait_event(self, event):
                cuda.log.append(("wait", self.name, event.timing))

            def synchronize(self):
                cuda.log.append(("stream_sync", self.name))

        self.Event, self.Stream = Event, Stream
        self.default = Stream(torch.device("cuda", 0), "default")
        self.streams_made = 0

    def install(self, monkeypatch):
        c = torch.cuda
        monkeypatch.setattr(c, "Stream", self.Stream)
        monkeypatch.setattr(c, "Event", self.Event)
        monkeypatch.setattr(c, "stream", lambda s: nullcontext())
        monkeypatch.setattr(c, "device", lambda d: nullcontext())
        monkeypatch.setattr(c, "current_stream", lambda d=None: self.default)
        monkeypatch.setattr(c, "current_device", lambda: 0)
        monkeypatch.setattr(c, "synchronize", lambda *a: pytest.fail("device-wide synchronize"))


def test_cuda_worker_times_on_its_stream_and_orders_by_events(monkeypatch):
    fake = FakeCuda()
    fake.install(monkeypatch)
    worker = Worker("target", 1, "cuda")

    def forward(ms):
        fake.now_ms += ms  # the forward's kernels take `ms` on the fake GPU
        return torch.zeros(2)

    async def two_runs():
        out = []
        for t0 in (10.0, 20.0):  # two runs: each gets its own reference event
            for ms in (5.0, 2.0):
                out.append(await worker.run(forward, ms, kind="decode", step=1, t0=t0))
        return out

    try:
        results = asyncio.run(two_runs())
    finally:
        worker.shutdown()
    assert worker.device == torch.device("cuda", 0) and isinstance(worker.stream, fake.Stream)
    queued = len(fake.log)
    spans = [runtime.settled(span) for _, span in results]  # read from the events only now
    assert [round(s.end - s.start, 6) for s in spans] == [0.005, 0.002, 0.005, 0.002]
    assert spans[1].start == spans[0].end and spans[3].start == spans[2].end  # back to back on the GPU clock
    first_forward = [
        ("record", "default", False),  # caller: what the loop queued before
        ("stream_sync", "worker"),
        ("record", "worker", True),
        ("event_sync",),  # the run's reference
        ("wait", "worker", False),  # the worker's stream waits on the caller's event
        ("record", "worker", True),
        ("record", "worker", True),  # start, end around fn
        ("event_sync",),  # the worker's thread waits for its forward's end, and only then
        ("wait", "default", True),  # does the caller's stream wait on it; the event loop never waits
    ]
    assert fake.log[: len(first_forward)] == first_forward
    assert fake.log.count(("stream_sync", "worker")) == 2  # one reference per run, not per forward
    assert fake.log[:queued].count(("event_sync",)) == 2 + 4  # the two references, and each forward's end
    assert fake.log[queued:] == [("event_sync",)] * 4  # each span waits for its end event when it is read


class WaitGraph:
    """Fake CUDA streams and events that keep what waits on what: a stream, every event it has waited on (and what
    those had waited on when recorded); an event, what its stream had waited on when it was recorded. An event
    recorded on a thread that called hold() (a forward still running on the device) stays pending until release(),
    and its synchronize() blocks the calling thread until then."""

    def __init__(self):
        self.released, self._holding = threading.Event(), set()
        self.blocked: dict[str, set] = {}  # a stream's name -> the pending events its recorded events waited on
        self.pending_seen = 0  # how many events were still pending when something waited on them
        graph, names = self, iter(range(1, 100))

        class Event:
            def __init__(self, enable_timing=False, blocking=False):
                self.after, self.pending, self.timing = frozenset(), False, enable_timing

            def record(self, stream):
                self.after = frozenset(stream.waited)
                graph.blocked.setdefault(stream.name, set()).update(e for e in self.after if e.pending)
                self.pending = threading.get_ident() in graph._holding
                graph._holding.discard(threading.get_ident())

            def synchronize(self):
                if self.pending:
                    graph.pending_seen += 1
                    assert graph.released.wait(10), "an event that never ran"

            def query(self):
                return not self.pending

            def elapsed_time(self, other):
                return 1.0

        class Stream:
            def __init__(self, device=None, name=None):
                self.device, self.name, self.waited = device, name or f"stream{next(names)}", set()

            def wait_event(self, event):
                self.waited |= {event} | event.after

            def synchronize(self):
                pass

        self.Event, self.Stream = Event, Stream
        self.default = Stream(torch.device("cuda", 0), "default")

    def hold(self) -> None:
        """The next event recorded on this thread is the end of a forward that keeps running until release()."""
        self._holding.add(threading.get_ident())

    def release(self) -> None:
        self.released.set()
        for events in self.blocked.values():
            for event in events:
                event.pending = False

    install = FakeCuda.install


def pinned_copies(monkeypatch) -> None:
    """Tensor.pin_memory as a CUDA build's (a CPU-only one has no page-locked memory): a copy, marked."""

    def pin_memory(self):
        copy = self.clone()
        copy.page_locked = True
        return copy

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)


def test_a_draft_step_does_not_wait_on_the_verify_pass_beside_it(monkeypatch):
    """PEARL's and SpecBranch's overlap: while the target's verify pass runs on the device, the draft steps beside it.
    Its steps must not wait on that pass: the loop's stream may wait on the pass's end only once the pass has run,
    since each draft step's `ready` event is recorded on that stream (before, it waited as soon as the pass was
    queued, and every later draft step waited on the verify). The ids each forward gets from the host are in
    page-locked memory, so that their copy to the device blocks no thread."""
    graph = WaitGraph()
    graph.install(monkeypatch)
    pinned_copies(monkeypatch)
    target, draft, seen = Worker("target", 1, "cuda"), Worker("draft", 1, "cuda"), []

    def verify(ids):
        seen.append(getattr(ids, "page_locked", False))
        graph.hold()  # the pass keeps running on the device until release()
        return ids + 1

    def step(ids):
        seen.append(getattr(ids, "page_locked", False))
        return ids * 2

    async def a_round():
        job = asyncio.ensure_future(target.run(verify, torch.ones(1, 4), kind="verify", step=1, t0=0.0, tokens=4))
        for _ in range(3):
            await asyncio.sleep(0.05)  # the loop's own work between draft steps (sampling): the pass was queued
            await draft.run(step, torch.ones(1, 1), kind="draft", step=1, t0=0.0)
        ran_beside = target._last_end.pending  # the verify had not run to its end while the draft stepped
        graph.release()
        out, _ = await job
        return ran_beside, out

    try:
        ran_beside, out = asyncio.run(a_round())
    finally:
        target.shutdown()
        draft.shutdown()
    assert ran_beside and torch.equal(out, torch.full((1, 4), 2.0))
    assert graph.blocked[draft.stream.name] == set()  # no draft event waited on the running verify
    assert graph.pending_seen == 1  # the target's thread waited for its pass, not the loop's
    assert seen == [True] * 4


def test_a_forward_copies_its_ids_to_the_device_without_blocking(tiny_dirs, monkeypatch):
    """LM.forward moves its ids with non_blocking=True: from the page-locked copy Worker.run made, the copy is
    queued on the worker's stream and the thread goes on (on the CPU a no-op either way)."""
    pair = load_pair(str(tiny_dirs["target"]), None, device="cpu")
    real, asked = torch.Tensor.to, []

    def to(self, *args, **kwargs):
        asked.append(kwargs.get("non_blocking", False))
        return real(self, *args, **kwargs)

    ids = torch.tensor([[2, 3, 4]])
    monkeypatch.setattr(torch.Tensor, "to", to)
    pair.target.forward(ids, pair.target.new_cache())
    monkeypatch.undo()
    assert asked[0] is True


def test_a_cuda_worker_makes_its_stream_at_its_first_forward(monkeypatch):
    """On ZeroGPU only the `spaces.GPU` function may touch CUDA: building a worker (as an Engine does, in the app's
    main process) makes no stream and asks CUDA nothing; its first forward makes the stream, once."""
    fake = FakeCuda()
    fake.install(monkeypatch)
    touched = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: touched.append("current_device") or 0)
    for device in ("cuda:0", "cuda"):
        worker = Worker("target", 1, device)
        assert fake.streams_made == 0 and touched == [] and fake.log == []

        async def twice():
            for _ in range(2):
                await worker.run(lambda: torch.zeros(1), kind="decode", step=1, t0=0.0)

        try:
            asyncio.run(twice())
        finally:
            worker.shutdown()
        assert fake.streams_made == 1 and worker.device == torch.device("cuda", 0)
        fake.streams_made, fake.log = 0, []
    assert touched == ["current_device"]  # `cuda` is named cuda:<current> at the first forward, not before


# ---------------------------------------------------------------- the CPU worker: host clocks, no CUDA calls
def test_cpu_worker_uses_host_clocks_and_never_syncs_the_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # as on a GPU machine with a CPU model
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: pytest.fail("device-wide synchronize"))
    worker = Worker("draft", 1, torch.device("cpu"))
    assert worker.stream is None and Worker("draft").stream is None

    async def go():
        return await worker.run(lambda x: x + 1, torch.ones(1), kind="draft", step=3, t0=0.0, tokens=2)

    try:
        result, span = asyncio.run(go())
    finally:
        worker.shutdown()
    assert float(result) == 2.0 and span.worker == "draft" and span.step == 3 and span.tokens == 2
    assert 0 < span.start <= span.end  # perf_counter seconds since t0 = 0


@pytest.mark.parametrize("target_forward", ["transformers", "static"])
def test_tensors_in_a_cache_and_an_output_are_found(tiny_dirs, target_forward):
    """What the CUDA path `record_stream`s: every key/value of a transformers cache or of a KV buffer (the static
    forward's), and every output tensor."""
    pair = load_pair(str(tiny_dirs["target"]), None, device="cpu", target_forward=target_forward)
    cache = pair.target.new_cache()
    out = pair.target.forward(torch.tensor([[2, 3, 4]]), cache, True, True)
    found = {id(t) for t in runtime._tensors(cache)}
    kv = (
        [(layer.keys, layer.values) for layer in cache.layers]
        if target_forward == "transformers"
        else list(zip(cache.keys, cache.values))
    )
    assert len(kv) == pair.target.model.config.num_hidden_layers
    for keys, values in kv:
        assert id(keys) in found and id(values) in found
    out_found = {id(t) for t in runtime._tensors(out)}
    assert {id(out.logits), id(out.features)} | {id(h) for h in out.hidden_states} <= out_found
    assert list(runtime._tensors(pair.target.model)) == []  # weights are never walked


# ---------------------------------------------------------------- unusable devices, refused before loading
@pytest.mark.parametrize(
    "available, count, argv, message",
    [
        (False, 0, ["--device", "cuda"], "CUDA is not available here"),
        (False, 0, ["--device", "cuda:0"], "CUDA is not available here"),
        (True, 1, ["--device", "cuda:1"], "'cuda:1': there is no such GPU; this machine has 1 (cuda:0)"),
        (True, 2, ["--device", "cpu", "--draft-device", "cuda:2"], "'cuda:2': there is no such GPU"),
        (False, 0, ["--draft-device", "cuda:0"], "CUDA is not available here"),
        (True, 1, ["--device", "gpu"], "unknown device 'gpu'; use cpu, cuda or cuda:N"),
        (True, 1, ["--device", "cuda:x"], "unknown device 'cuda:x'"),
        (True, 1, ["--device", "meta"], "device 'meta' is not supported"),
    ],
)
def test_unusable_device_is_refused_before_loading(monkeypatch, capsys, tmp_path, available, count, argv, message):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    code = main(["generate", "--target", str(tmp_path / "no-such-model"), "--prompt", "a b", *argv])
    err = capsys.readouterr().err
    assert code == 2 and message in err, err
    assert "model path not found" not in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: ")


def test_usable_devices_pass(monkeypatch):
    assert pick_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    # `cuda` by its canonical name, the one its tensors and the workers report (models/devices.py)
    assert pick_device("cuda:1") == torch.device("cuda", 1) and pick_device("cuda") == torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert pick_device(None) == torch.device("cpu")
    with pytest.raises(SpecBranchError, match="device 'cuda': CUDA is not available here"):
        pick_device("cuda")


# ---------------------------------------------------------------- out of memory ends one run only
@pytest.fixture
def own_engine(tmp_path):
    """A fresh tiny engine (the shared `tiny_engine` fixture is left alone)."""
    target = make_tiny_model(tmp_path / "target", seed=1)
    draft = make_tiny_model(tmp_path / "draft", seed=1, perturb=0.5, perturb_seed=2)
    engine = Engine(load_pair(str(target), str(draft), device="cpu"))
    yield engine
    engine.close()


def fail_once(lm, monkeypatch, after: int = 0):
    """Make lm.forward raise CUDA's out-of-memory error on its (after + 1)-th call, then work again."""
    real, calls = lm.forward, []

    def forward(*args, **kwargs):
        calls.append(1)
        if len(calls) == after + 1:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(*args, **kwargs)

    monkeypatch.setattr(lm, "forward", forward)
    return calls


@pytest.mark.parametrize(
    "method, model, after",
    [("sd", "target", 0), ("sd", "target", 3), ("pearl", "target", 2), ("specbranch", "draft", 4), ("ar", "target", 5)],
)
def test_out_of_memory_ends_the_run_and_the_next_run_works(own_engine, monkeypatch, method, model, after):
    cfg = GenerationConfig(method=method, max_new_tokens=24, gamma=3)
    want = own_engine.run([2, 3, 4], cfg).token_ids
    emptied = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the allocator's cache is emptied on CUDA
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(1))
    calls = fail_once(getattr(own_engine.pair, model), monkeypatch, after)
    with pytest.raises(OutOfMemory, match=f"out of memory on cpu in the {model} model's"):
        own_engine.run([2, 3, 4], cfg)
    assert emptied == [1] and len(calls) == after + 1
    again = own_engine.run([2, 3, 4], cfg)
    assert again.token_ids == want and again.finish_reason == "length"


def test_out_of_memory_from_the_cli_is_one_error_line(tmp_path, monkeypatch, capsys):
    target = make_tiny_model(tmp_path / "target", seed=1)
    real, calls = LM.forward, []

    def forward(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory.")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(LM, "forward", forward)
    capsys.readouterr()  # the model writer's progress bar
    code = main(
        [
            "generate",
            "--target",
            str(target),
            "--method",
            "ar",
            "--prompt",
            "a b",
            "--device",
            "cpu",
            "--max-new-tokens",
            "8",
        ]
    )
    err = capsys.readouterr().err.splitlines()  # after transformers' loading progress bar
    assert code == 2
    assert err[-1].startswith("error: out of memory on cpu in the target model's decode forward (1 token)")
    assert "Traceback" not in "\n".join(err)


# ---------------------------------------------------------------- distill takes its device
def test_head_distill_tensors_are_made_on_the_given_device(tiny_dirs):
    from engine.drafts.head import FeatureHead
    from engine.training.head_distill import feature_batches, ttt_mask, unrolled_outputs

    cpu = torch.device("cpu")
    rows = [{"prompt_ids": [2, 3], "response_ids": [4, 5, 6]}, {"prompt_ids": [2], "response_ids": [7]}]
    feats = [torch.randn(5, 32, dtype=torch.float16), torch.randn(2, 32, dtype=torch.float16)]
    batches = list(feature_batches(rows, feats, 2, False, 0, cpu))
    assert batches and all(t.device == cpu for batch in batches for t in batch)
    assert torch.equal(ttt_mask(5, 2, cpu), ttt_mask(5, 2))
    target = load_pair(str(tiny_dirs["target"]), None, device="cpu").target.model
    head = FeatureHead.from_target(target, 1)
    ids, f, _, _ = batches[0]  # ids, the head's input features, the labels' features, the loss mask
    outs = unrolled_outputs(head, target.get_input_embeddings()(ids).float(), f, 2)
    assert len(outs) == 2 and all(o.shape == f.shape and o.device == cpu for o in outs)


def test_distill_head_with_device_cpu(tmp_path):
    """`distill --kind head --device cpu` runs every stage (features, feature batches, training, evaluation)."""
    target = make_tiny_model(tmp_path / "target", seed=5, layers=3, init=0.3, context=128)
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(
        "".join(
            json.dumps({"prompt_ids": [2 + i % 5, 3], "response_ids": [4, 5 + i % 4, 6, 7]}) + "\n" for i in range(24)
        )
    )
    code = main(
        [
            "distill",
            "--kind",
            "head",
            "--target",
            str(target),
            "--corpus",
            str(corpus),
            "--layers",
            "1",
            "--unroll",
            "2",
            "--vocab",
            "8",
            "--epochs",
            "1",
            "--batch-size",
            "8",
            "--val-fraction",
            "0.2",
            "--work-dir",
            str(tmp_path / "work"),
            "--out",
            str(tmp_path / "head"),
            "--device",
            "cpu",
        ]
    )
    assert code == 0
    card = json.loads((tmp_path / "head" / "config.json").read_text())["specbranch_head"]
    assert card["unroll"] == 2 and len(card["val_agreement_by_depth"]) == 2


def test_the_cuda_sanitizer_checks_the_workers_threads_too(monkeypatch):
    """TORCH_CUDA_SANITIZER's dispatch mode is per thread, entered at import on the main thread only, while the
    forwards run on the workers' threads: a worker thread enters it too when it is on, and says so (gpu-check's
    sanitizer section lists the threads it checked instead of a bare "races: 0")."""
    import types

    import torch.cuda._sanitizer as sanitizer

    entered = []

    class Mode:
        def __enter__(self):
            entered.append(threading.current_thread().name)
            return self

    monkeypatch.setattr(sanitizer, "cuda_sanitizer", types.SimpleNamespace(enabled=True, dispatch=Mode()))
    worker = Worker("sanitized")
    try:
        asyncio.run(worker.run(lambda: torch.ones(1), kind="decode", step=0, t0=0.0))
    finally:
        worker.shutdown()
    assert entered == ["specbranch-sanitized_0"] and "specbranch-sanitized_0" in runtime.sanitized_threads()
