"""The scheduler: admitted work runs one turn at a time, forward passes of different sessions run batched,
results equal running alone, a failing pass fails only its own work; and on the server, concurrent
sessions get the replies they would get one at a time, and a cancelled stream leaves the batch."""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
from hf_models import build
from server_harness import MODEL_NAME, running_app, serve_options

from kvos.builtin import MODEL_DIR
from kvos.engine.engine import Engine
from kvos.engine.scheduler import Scheduler, _Ask, _Worker
from kvos.engine.sequence import Sequence
from kvos.engine.step_costs import MIN_SLICE, StepCosts
from kvos.model.loader import load_model

TOL = 1e-4


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    return Engine(load_model(build("qwen2", tmp_path_factory.mktemp("qwen2"))), block_size=4)


@pytest.fixture
def scheduler(engine: Engine) -> Iterator[Scheduler]:
    sched = Scheduler(engine.model, engine.pool, max_running=3, step_tokens=64, stall=None)
    yield sched
    sched.shutdown()


def _tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 97, (n,), generator=g).tolist()


def _greedy(engine: Engine, seq: Sequence, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """Prefill, then greedy decode: the tokens and the last step's logits."""
    logits = engine.extend(seq, prompt)[0]
    out = []
    for _ in range(steps):
        out.append(int(torch.argmax(logits)))
        logits = engine.decode(seq, out[-1])
    return out, logits


def _step_sizes(scheduler: Scheduler) -> list[int]:
    """A list that gets the token count of every step the scheduler runs from now on."""
    sizes: list[int] = []
    real_run = scheduler._run

    def spy(step: list[_Ask]) -> None:
        sizes.append(sum(a.tokens for a in step))
        real_run(step)

    scheduler._run = spy  # type: ignore[method-assign]
    return sizes


def test_concurrent_work_is_batched_and_equals_running_alone(engine: Engine, scheduler: Scheduler) -> None:
    prompts = [_tokens(n, seed) for seed, n in enumerate((5, 30, 12, 21, 9))]
    alone = []
    for prompt in prompts:
        seq = engine.new_sequence()
        alone.append(_greedy(engine, seq, prompt, 10))  # not on a worker: runs directly
        seq.release()
    seqs = [engine.new_sequence() for _ in prompts]
    futures = [scheduler.submit(_greedy, engine, s, p, 10) for s, p in zip(seqs, prompts, strict=True)]
    together = [f.result(timeout=120) for f in futures]
    for (tokens, logits), (tokens_b, logits_b) in zip(alone, together, strict=True):
        assert tokens == tokens_b
        assert (logits - logits_b).abs().max().item() <= TOL
    assert scheduler.stats.max_items == 3  # max_running works decoding side by side, one pass per step
    assert scheduler.stats.steps < sum(len(p) // 64 + 1 + 10 for p in prompts)  # fewer passes than alone
    for seq in seqs:
        seq.release()


def test_never_more_than_max_running(engine: Engine, scheduler: Scheduler) -> None:
    inside, peak, lock = 0, 0, threading.Lock()

    def work(seed: int) -> None:
        nonlocal inside, peak
        with lock:
            inside += 1
            peak = max(peak, inside)
        seq = engine.new_sequence()
        _greedy(engine, seq, _tokens(4, seed), 3)
        seq.release()
        with lock:
            inside -= 1

    for f in [scheduler.submit(work, seed) for seed in range(8)]:
        f.result(timeout=120)
    assert peak == scheduler.max_running


def test_the_turn_passes_from_worker_to_worker_and_comes_back_once_a_step(
    engine: Engine, scheduler: Scheduler
) -> None:
    backs = 0
    real_back = scheduler._back

    class Counted:
        """The loop's semaphore, counting how often the turn comes back to it."""

        def release(self) -> None:
            nonlocal backs
            backs += 1
            real_back.release()

        def acquire(self) -> bool:
            return real_back.acquire()

    scheduler._back = Counted()  # type: ignore[assignment]
    seqs = [engine.new_sequence() for _ in range(3)]
    futures = [scheduler.submit(_greedy, engine, s, _tokens(4, i), 12) for i, s in enumerate(seqs)]
    for f in futures:
        f.result(timeout=120)
    turns = scheduler.stats.items + len(futures)  # a turn ends at each pass asked for and at each work's end
    assert scheduler.stats.max_items == 3 and turns >= 3 * 13
    # once per step (and at most once more per work, where a work ends or enters alone), not once per turn
    assert backs <= scheduler.stats.steps + 2 * len(futures) < turns
    for seq in seqs:
        seq.release()


def test_after_turns_runs_on_the_loop_once_the_turns_between_two_steps_have_ended(
    engine: Engine, scheduler: Scheduler
) -> None:
    """The hook sees every turn of the phase that just ended (what each worker did before giving the
    turn up) and runs while no worker holds the turn: once a step, not once a turn."""
    marks: list[int] = []  # a worker's mark at the end of each of its turns
    in_turn = threading.Event()
    seen: list[tuple[int, bool, str]] = []  # (marks so far, a worker in its turn, the hook's thread)

    def greedy_marking(seq: Sequence, prompt: list[int], steps: int) -> None:
        logits = engine.extend(seq, prompt)[0]
        for _ in range(steps):
            in_turn.set()
            token = int(torch.argmax(logits))
            marks.append(token)
            in_turn.clear()
            logits = engine.decode(seq, token)

    def hook() -> None:
        seen.append((len(marks), in_turn.is_set(), threading.current_thread().name))

    scheduler.after_turns(hook)
    seqs = [engine.new_sequence() for _ in range(3)]
    futures = [scheduler.submit(greedy_marking, s, _tokens(4, i), 10) for i, s in enumerate(seqs)]
    for f in futures:
        f.result(timeout=120)
    deadline = time.monotonic() + 10
    while not seen or seen[-1][0] < len(marks):  # the last phase's hook runs after the works have ended
        assert time.monotonic() < deadline, "the hook did not run after the last turns"
        time.sleep(0.01)
    assert len(marks) == 30
    assert all(not busy and thread == "kvos-scheduler" for _, busy, thread in seen)
    counts = [n for n, _, _ in seen]
    assert counts == sorted(counts)
    # once a step: the marks of all three sessions' decodes arrive three at a time
    assert len(seen) <= scheduler.stats.steps + 2 * len(futures) < len(marks) + scheduler.stats.steps
    assert sum(1 for a, b in itertools.pairwise(counts) if b - a == 3) >= 8
    for seq in seqs:
        seq.release()


def test_a_failing_after_turns_hook_does_not_stop_the_scheduler(engine: Engine, scheduler: Scheduler) -> None:
    def fail() -> None:
        raise RuntimeError("a broken hook")

    scheduler.after_turns(fail)
    seq = engine.new_sequence()
    tokens, _ = scheduler.submit(_greedy, engine, seq, _tokens(5, 1), 4).result(timeout=120)
    assert len(tokens) == 4
    seq.release()


def test_when_idle_runs_on_the_loop_once_no_work_is_running(engine: Engine, scheduler: Scheduler) -> None:
    """The idle hook runs on the scheduler's thread, never while a work is admitted and not ended (a step
    to run, a turn to hand over), and once the works have ended."""
    active = [0]  # works inside their function
    seen: list[tuple[int, bool, str]] = []  # (active works, others_running() there, the hook's thread)

    def greedy_counted(seq: Sequence, prompt: list[int], steps: int) -> list[int]:
        active[0] += 1
        try:
            return _greedy(engine, seq, prompt, steps)[0]
        finally:
            active[0] -= 1

    def hook() -> None:
        seen.append((active[0], scheduler.others_running(), threading.current_thread().name))

    scheduler.when_idle(hook)
    seqs = [engine.new_sequence() for _ in range(3)]
    futures = [scheduler.submit(greedy_counted, s, _tokens(4, i), 8) for i, s in enumerate(seqs)]
    for f in futures:
        assert len(f.result(timeout=120)) == 8
    deadline = time.monotonic() + 10
    while not seen or seen[-1][0]:
        assert time.monotonic() < deadline, "the idle hook did not run after the works ended"
        time.sleep(0.01)
    assert seen and all(n == 0 and not others and t == "kvos-scheduler" for n, others, t in seen)
    for seq in seqs:
        seq.release()


def test_others_running_sees_the_other_admitted_works(engine: Engine, scheduler: Scheduler) -> None:
    started, done = threading.Event(), threading.Event()

    def long_decode(seq: Sequence) -> None:
        started.set()
        logits = engine.extend(seq, _tokens(4, 7))[0]
        while not done.is_set():
            logits = engine.decode(seq, int(torch.argmax(logits)))

    def look() -> bool:
        return scheduler.others_running()

    seqs = [engine.new_sequence() for _ in range(2)]
    other = scheduler.submit(long_decode, seqs[0])
    assert started.wait(60)
    beside = scheduler.submit(look).result(timeout=60)
    done.set()
    other.result(timeout=60)
    alone = scheduler.submit(look).result(timeout=60)
    assert (beside, alone) == (True, False)
    assert not scheduler.others_running()  # off the workers: nothing is running
    for seq in seqs:
        seq.release()


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="CPU affinity is a Linux call")
@pytest.mark.parametrize("pin", [True, False])
def test_the_workers_share_one_cpu(engine: Engine, pin: bool) -> None:
    allowed = os.sched_getaffinity(0)
    sched = Scheduler(engine.model, engine.pool, max_running=3, step_tokens=64, pin_workers=pin)
    try:
        seen = [f.result(timeout=60) for f in [sched.submit(os.sched_getaffinity, 0) for _ in range(6)]]
    finally:
        sched.shutdown()
    assert all(cpus == ({min(allowed)} if pin else allowed) for cpus in seen)
    assert os.sched_getaffinity(0) == allowed  # the calling thread keeps its own


def test_prefill_slices_share_steps_with_decodes(engine: Engine, scheduler: Scheduler) -> None:
    """A 200-token prompt is prefilled in slices cut to fit a step beside every running decode token
    (64 - 3 = 61 tokens) while another work decodes: no step holds more than ``step_tokens``, and the
    decode runs in the same steps as the slices; the logits equal an unsliced prefill's."""
    sizes = _step_sizes(scheduler)
    a, b, ref = engine.new_sequence(), engine.new_sequence(), engine.new_sequence()
    fb = scheduler.submit(_greedy, engine, b, _tokens(3, 1), 12)
    fa = scheduler.submit(_greedy, engine, a, _tokens(200, 2), 2)
    fb.result(timeout=120)
    assert scheduler.slice_tokens == 61
    assert max(sizes) <= scheduler.step_tokens
    assert 62 in sizes  # a 61-token slice with one decode token beside it
    tokens, logits = fa.result(timeout=120)
    tokens_ref, logits_ref = _greedy(engine, ref, _tokens(200, 2), 2)  # one 200-token pass
    assert tokens == tokens_ref and (logits - logits_ref).abs().max().item() <= TOL
    for seq in (a, b, ref):
        seq.release()


class _FixedCosts(StepCosts):
    """Step costs that do not learn: a decode step 0.1 s, 0.01 s per prefill token."""

    def observe(self, decode_rows: int, prefill_tokens: int, seconds: float) -> None:
        return None


def _stalled_scheduler(engine: Engine) -> tuple[Scheduler, list[tuple[int, int]]]:
    """A scheduler with ``stall=3`` whose steps are costed at 0.1 s per decode step and 0.01 s per prefill
    token (a step beside decodes carries at most (3 - 1) * 0.1 / 0.01 = 20 prefill tokens), and the list
    that gets each step's (decode rows, prefill tokens)."""
    sched = Scheduler(engine.model, engine.pool, max_running=3, step_tokens=64, stall=3.0)
    sched.costs = _FixedCosts(decode_s=0.1, token_s=0.01)
    steps: list[tuple[int, int]] = []
    real_run = sched._run

    def spy(step: list[_Ask]) -> None:
        steps.append((sum(a.tokens == 1 for a in step), sum(a.tokens for a in step if a.tokens > 1)))
        real_run(step)

    sched._run = spy  # type: ignore[method-assign]
    return sched, steps


def test_beside_decodes_a_step_carries_only_the_prefill_its_stall_budget_allows(engine: Engine) -> None:
    """With ``stall=3`` and steps measured at 0.1 s per decode step and 0.01 s per prefill token, a step
    beside decoding work carries at most (3 - 1) * 0.1 / 0.01 = 20 prefill tokens: a 200-token prompt goes
    in 20-token slices while another work decodes (and in slices of step_tokens - max_running = 61 once it
    decodes alone), with the logits of an unsliced prefill."""
    sched, steps = _stalled_scheduler(engine)
    try:
        a, b, ref = engine.new_sequence(), engine.new_sequence(), engine.new_sequence()
        fb = sched.submit(_greedy, engine, b, _tokens(3, 1), 30)
        deadline = time.monotonic() + 60
        while not any(d for d, _ in steps) and time.monotonic() < deadline:
            time.sleep(0.005)  # b decodes before a's prompt arrives
        fa = sched.submit(_greedy, engine, a, _tokens(200, 2), 2)
        fb.result(timeout=120)
        tokens, logits = fa.result(timeout=120)
    finally:
        sched.shutdown()
    beside = [p for d, p in steps if d and p]
    assert beside and max(beside) <= 20  # every slice that shared a step with a decode
    assert 20 in beside
    tokens_ref, logits_ref = _greedy(engine, ref, _tokens(200, 2), 2)
    assert tokens == tokens_ref and (logits - logits_ref).abs().max().item() <= TOL
    for seq in (a, b, ref):
        seq.release()


def test_a_session_prefilling_after_its_own_decode_is_not_held_to_the_stall_budget(engine: Engine) -> None:
    """The stall budget protects *other* sessions' inter-token latency: a work that decodes and then
    prefills 50 tokens (the server's re-sync of a reply it has just streamed) while no one else decodes
    goes in one 50-token step, not in the 20-token slices of :func:`test_beside_decodes_...` (the last
    step's decode was its own); its logits equal an unsliced prefill's."""
    sched, steps = _stalled_scheduler(engine)

    def decode_then_prefill(seq: Sequence) -> torch.Tensor:
        _greedy(engine, seq, _tokens(5, 3), 3)
        return engine.extend(seq, _tokens(50, 4))[0]

    seq, ref = engine.new_sequence(), engine.new_sequence()
    try:
        logits = sched.submit(decode_then_prefill, seq).result(timeout=120)
    finally:
        sched.shutdown()
    assert steps == [(0, 5), (1, 0), (1, 0), (1, 0), (0, 50)]
    _greedy(engine, ref, _tokens(5, 3), 3)
    ref_logits = engine.extend(ref, _tokens(50, 4))[0]
    assert (logits - ref_logits).abs().max().item() <= TOL
    for s in (seq, ref):
        s.release()


def test_only_the_last_slice_of_a_prefill_runs_the_output_head(engine: Engine) -> None:
    """A prompt longer than a slice: the earlier slices' passes ask for no logits (their last rows'
    logits would be thrown away: a whole output head and its statistics each), the last asks for its last
    token's; the logits equal one unsliced pass's."""
    sliced = Engine(engine.model, block_size=4, prefill_slice=16)
    asked: list[str] = []
    real_forward = sliced.model.forward_batch

    def spy(items: list, kv: object) -> list[torch.Tensor]:  # type: ignore[type-arg]
        asked.extend(item.logits for item in items)
        return real_forward(items, kv)  # type: ignore[arg-type]

    seq, ref = sliced.new_sequence(), engine.new_sequence()
    sliced.model.forward_batch = spy  # type: ignore[method-assign]
    try:
        logits = sliced.extend(seq, _tokens(40, 5))
    finally:
        del sliced.model.forward_batch
    assert asked == ["none", "none", "last"] and logits.shape == (1, sliced.model.config.vocab_size)
    assert (logits - engine.extend(ref, _tokens(40, 5))).abs().max().item() <= TOL
    seq.release()
    ref.release()


def test_serve_stall_option_reaches_the_scheduler() -> None:
    """``kvos serve`` defaults to a stall budget of 3 decode steps; ``--stall 0`` turns it off; a factor
    of 1 or below (a step shorter than a decode step) is refused."""
    for argv, stall in (((), 3.0), (("--stall", "5"), 5.0), (("--stall", "0"), None)):
        with running_app(MODEL_DIR, *argv) as (_, app):
            assert app.state.scheduler.stall == stall  # the scheduler every request runs under
    with pytest.raises(SystemExit):
        serve_options(["--stall", "1"])


def test_step_costs_learn_a_decode_step_and_a_prefill_token() -> None:
    costs = StepCosts(alpha=0.5)
    assert costs.prefill_budget(3.0) is None  # nothing measured: no limit
    costs.observe(4, 0, 0.2)  # decode only
    costs.observe(4, 100, 1.2)  # 1.0 s over a decode step for 100 tokens
    assert costs.decode_s == pytest.approx(0.2) and costs.token_s == pytest.approx(0.01)
    assert costs.prefill_budget(3.0) == 40
    costs.observe(4, 0, 0.4)
    assert costs.decode_s == pytest.approx(0.3)
    assert costs.prefill_budget(1.01) == MIN_SLICE  # a prefill always progresses


def test_standalone_passes_run_in_a_step_and_touch_no_pool(engine: Engine, scheduler: Scheduler) -> None:
    """An embedding's pass (Engine.hidden_states) under the scheduler waits for the next step, beside the
    other work, reads and writes no pool slot, and equals the pass run alone."""
    alone = engine.hidden_states(_tokens(9, 4))
    live = engine.pool.live_bytes
    seq = engine.new_sequence()
    decoding = scheduler.submit(_greedy, engine, seq, _tokens(5, 5), 6)
    under = scheduler.submit(engine.hidden_states, _tokens(9, 4)).result(timeout=60)
    decoding.result(timeout=60)
    seq.release()
    assert torch.equal(under, alone) or (under - alone).abs().max().item() <= TOL
    assert engine.pool.live_bytes == live


def test_one_works_passes_share_a_step_or_are_cut_by_its_limits(engine: Engine, scheduler: Scheduler) -> None:
    """Engine.step on a worker: its sequences' passes join one step when they fit (three 12-token
    passes: one step of 36 tokens), are spread over steps when they do not (four 30-token passes in a
    64-token step: 30 + 30, then 30 + 30), and the worker gets the turn back once all have run, each
    output as its pass alone would give it."""
    prompts = [_tokens(12, 20 + i) for i in range(3)] + [_tokens(30, 30 + i) for i in range(4)]
    alone = []
    for prompt in prompts:
        seq = engine.new_sequence()
        alone.append(engine.extend(seq, prompt, logits="all"))
        seq.release()
    sizes = _step_sizes(scheduler)

    def both() -> list[torch.Tensor]:
        first = [engine.new_sequence() for _ in range(3)]
        second = [engine.new_sequence() for _ in range(4)]
        out = engine.step(list(zip(first, prompts[:3], strict=True)), logits="all")
        out += engine.step(list(zip(second, prompts[3:], strict=True)), logits="all")
        for seq in first + second:
            seq.release()
        return out

    together = scheduler.submit(both).result(timeout=120)
    assert sizes == [36, 60, 60]
    for a, b in zip(alone, together, strict=True):
        assert a.shape == b.shape and (a - b).abs().max().item() <= TOL


def test_a_failing_pass_fails_only_its_own_work(engine: Engine, scheduler: Scheduler) -> None:
    """A token id past the vocabulary breaks the batched pass of a step; the step is re-run ask by ask,
    so the other ask gets its right result and only the bad one gets the error."""
    good_seq, bad_seq, ref = engine.new_sequence(), engine.new_sequence(), engine.new_sequence()
    good = _Ask(_Worker(), engine._item(good_seq, _tokens(7, 3), list(range(7)), "last"))
    bad = _Ask(_Worker(), engine._item(bad_seq, [5, 10_000], [0, 1], "last"))
    scheduler._run([good, bad])
    assert isinstance(bad.error, IndexError) and bad.result is None
    assert good.error is None and good.result is not None
    assert (good.result - engine.extend(ref, _tokens(7, 3))).abs().max().item() <= TOL


def test_a_failed_extend_under_the_scheduler_rolls_back(engine: Engine, scheduler: Scheduler) -> None:
    seq = engine.new_sequence()
    engine.extend(seq, [1, 2, 3])
    with pytest.raises(IndexError):
        scheduler.submit(engine.extend, seq, [5, 10_000]).result(timeout=60)
    assert seq.token_ids == [1, 2, 3]
    assert scheduler.submit(lambda: 42).result(timeout=60) == 42  # the scheduler goes on
    seq.release()


# ------------------------------------------------------------------ the server on the scheduler
QUESTIONS = [
    "Tell me about the sea.",
    "What is a block allocator?",
    "Write a short poem about trees.",
    "Why is the sky blue?",
]


def _chat(url: str, session: str, question: str) -> str:
    body = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": question}],
        "max_tokens": 24,
        "temperature": 0,
    }
    r = httpx.post(f"{url}/chat/completions", json=body, headers={"X-Session-Id": session}, timeout=120)
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["message"]["content"])


def test_server_sessions_at_once_get_the_replies_they_get_alone() -> None:
    """Four sessions at once on ``kvos serve``'s defaults give the same greedy replies as with
    ``--max-running 1`` (one request at a time), and their decode steps ran batched."""
    with running_app(MODEL_DIR, "--max-running", "1") as (url, _):
        alone = [_chat(url, f"s{i}", q) for i, q in enumerate(QUESTIONS)]
    with running_app(MODEL_DIR) as (url, app):
        with ThreadPoolExecutor(len(QUESTIONS)) as pool:
            together = list(pool.map(lambda iq: _chat(url, f"s{iq[0]}", iq[1]), enumerate(QUESTIONS)))
        stats = app.state.scheduler.stats
    assert together == alone
    assert stats.max_items >= 2
    assert stats.forward_s > 0 and stats.turns_s > 0  # the model's share of the time and the sessions' own


def test_server_cancelled_stream_leaves_the_batch(tmp_path: Path) -> None:
    """A stream whose client goes away stops within a step while another session keeps decoding; the
    other session's reply is whole and the cancelled one is idle again at once."""
    with running_app(MODEL_DIR) as (url, app):
        body = {
            "model": MODEL_NAME,
            "messages": [{"role": "user", "content": "Describe every wave of the sea."}],
            "max_tokens": 300,
            "stream": True,
            "ignore_eos": True,
        }
        other: Future[str]
        with ThreadPoolExecutor(1) as pool:
            request = httpx.Request(
                "POST", f"{url}/chat/completions", json=body, headers={"X-Session-Id": "c"}
            )
            response = httpx.Client(timeout=60).send(request, stream=True)
            lines = response.iter_lines()
            for _ in range(4):
                next(lines)
            other = pool.submit(_chat, url, "other", QUESTIONS[0])
            time.sleep(0.2)
            response.close()
            reply = other.result(timeout=120)
        assert reply
        registry = app.state.service.registry
        deadline = time.monotonic() + 10
        while any(e.busy for e in registry.entries.values()):
            assert time.monotonic() < deadline, "a session stayed busy after its stream was cancelled"
            time.sleep(0.02)
