"""One thread computes with torch's intra-op threads; the others start no pool of helper threads.

Each case runs in a fresh interpreter: the process-wide default thread count it changes would otherwise
outlive the test. Skipped where torch has no OpenMP runtime to reach (then kvos leaves threads to torch).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from kvos.engine.threads import _runtime


def run(code: str) -> dict:
    """``code`` in a fresh interpreter; the JSON object it printed last."""
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


pytestmark = pytest.mark.skipif(_runtime() is None, reason="torch has no OpenMP runtime to reach here")


def test_thread_count_is_the_callers_alone_and_other_threads_start_no_helpers() -> None:
    seen = run(
        """
        import json, os, threading, time, torch
        from kvos.engine.threads import on_passing_thread, set_thread_count, single_threaded_default

        x = torch.randn(2000, 2000)
        def threads():
            return len(os.listdir("/proc/self/task"))
        def settled(at_most):  # an ended thread's helpers leave a moment after it
            for _ in range(400):
                if threads() <= at_most:
                    break
                time.sleep(0.025)
            return threads()
        def in_thread(fn):
            out = []
            t = threading.Thread(target=lambda: out.append(fn()))
            t.start(); t.join()
            return out[0]

        torch.set_num_threads(2)
        before = threads()
        on_passing_thread(lambda: x.exp())  # set-up work: its helpers go with its thread
        after_setup = settled(before)
        single_threaded_default()
        def compute():
            set_thread_count(2)
            x.exp()
            return torch.get_num_threads(), threads()
        own, with_pool = in_thread(compute)
        settled(before)
        def other():
            start = threads()
            x.exp(); x.softmax(-1)
            return torch.get_num_threads(), threads() - start
        other_count, other_started = in_thread(other)
        print(json.dumps(dict(before=before, after_setup=after_setup, own=own, with_pool=with_pool,
                              other=other_count, other_started=other_started,
                              main=torch.get_num_threads())))
        """
    )
    assert seen["after_setup"] == seen["before"]  # the passing thread's pool ended with it
    assert seen["own"] == 2 and seen["with_pool"] == seen["before"] + 2  # itself and one helper
    assert seen["other"] == 1 and seen["main"] == 1
    assert seen["other_started"] == 0  # no helper started


def test_scheduler_steps_keep_their_threads_and_workers_compute_alone() -> None:
    """Set up as ``kvos serve`` does: the model loaded on a passing thread, one thread the default, a
    scheduler given 2 threads. Every step runs with 2, whatever the workers' threads copied, and a
    worker's own operators run single-threaded."""
    seen = run(
        """
        import json, torch
        from kvos.builtin import builtin_model_path
        from kvos.engine.engine import Engine
        from kvos.engine.scheduler import Scheduler
        from kvos.engine.threads import on_passing_thread, single_threaded_default
        from kvos.model.loader import load_model

        engine = on_passing_thread(lambda: Engine(load_model(builtin_model_path())))
        single_threaded_default()
        scheduler = Scheduler(engine.model, engine.pool, threads=2)
        steps = []
        forward = engine.model.forward_batch
        def counted(*args, **kwargs):
            steps.append(torch.get_num_threads())
            return forward(*args, **kwargs)
        engine.model.forward_batch = counted
        def work():
            seq = engine.new_sequence()
            logits = engine.extend(seq, list(range(5, 60)))
            worker = torch.get_num_threads()
            for _ in range(4):
                logits = engine.decode(seq, int(logits.argmax()))
            engine.release(seq)
            return worker
        workers = [scheduler.submit(work).result() for _ in range(2)]
        scheduler.shutdown()
        print(json.dumps(dict(steps=steps, workers=workers)))
        """
    )
    assert len(seen["steps"]) >= 10 and set(seen["steps"]) == {2}
    assert seen["workers"] == [1, 1]
