"""The scheduler's thread is the model's (engine/scheduler.py, engine/threads.py): its steps and
the model work sent through ``Scheduler.call`` run there, on the replica's torch threads, and
threads that start torch work after it run on one."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from kvsnap.engine import SamplingParams
from kvsnap.engine.scheduler import Scheduler
from kvsnap.engine.threads import set_default_threads
from kvsnap.errors import Unavailable
from kvsnap.policies import make_policy

from ..conftest import random_tokens


@pytest.fixture
def restore_default_threads():
    before = torch.get_num_threads()
    yield
    set_default_threads(before)  # threads started from now on take the main thread's again


def _threads_of_a_new_thread() -> int:
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(torch.get_num_threads).result()


def test_model_work_runs_on_the_scheduler_thread_with_its_threads(llama_engine, restore_default_threads):
    scheduler = Scheduler(llama_engine, threading.RLock(), max_batch=2, threads=2)
    try:
        where = scheduler.call(lambda: (threading.current_thread().name, torch.get_num_threads()))
        assert where == ("kvsnap-scheduler", 2)
        assert _threads_of_a_new_thread() == 1  # request threads make no OpenMP team of their own
        # a turn and model work between its steps: both done, the turn's tokens as alone
        prompt, sampling = random_tokens(40, seed=8), SamplingParams(max_new_tokens=8)
        alone = llama_engine.turn(llama_engine.new_session(make_policy("full")), prompt, sampling)
        job = scheduler.submit(llama_engine.start(llama_engine.new_session(make_policy("full")), prompt, sampling))
        assert scheduler.call(lambda: 41 + 1) == 42
        assert list(job) == alone.tokens
        with pytest.raises(ValueError, match="bad work"):
            scheduler.call(_fail)  # its error is the caller's, and the scheduler goes on
        assert scheduler.call(lambda: "still here") == "still here"
    finally:
        scheduler.stop()
    scheduler._thread.join(timeout=30)
    with pytest.raises(Unavailable):
        scheduler.call(lambda: None)


def test_a_scheduler_without_a_thread_runs_model_work_inline_under_its_lock(llama_engine):
    lock = threading.RLock()
    scheduler = Scheduler(llama_engine, lock, max_batch=2, start=False)
    assert scheduler.call(lambda: (threading.current_thread() is threading.main_thread(), lock._is_owned())) == (
        True,
        True,
    )


def _fail():
    raise ValueError("bad work")
