"""The decode step's threads follow the cores they get (llama/runtime/threads.py): fewer when the process gets less
than a core a thread, more again when a core is idle, never more than the caller's count, which comes back after."""

import pytest
import torch

from llama.runtime import threads
from llama.runtime.threads import StepThreads, choose_threads, idle_seconds


@pytest.mark.parametrize("now, most, cpu, idle, chosen", [
    (2, 2, 2.1, 0.0, 2),  # both threads on their cores (spinning between regions counts as CPU time)
    (2, 2, 1.3, 0.0, 1),  # one busy process beside: two threads get 1.3 cores
    (2, 2, 1.0, 0.0, 1),  # two busy processes beside
    (8, 8, 5.5, 0.0, 5),  # on a bigger machine, as many as the cores got
    (8, 8, 0.3, 0.0, 1),
    (1, 2, 1.0, 0.0, 1),  # no core idle: stay
    (1, 2, 1.0, 0.9, 2),  # one idle
    (1, 8, 1.0, 3.9, 5),
    (1, 2, 1.0, 3.0, 2),  # never above the caller's count
    (1, 1, 0.5, 0.0, 1),  # never below one
])
def test_choose_threads(now, most, cpu, idle, chosen):
    assert choose_threads(now, most, wall=1.0, cpu=cpu, idle=idle) == chosen


class Machine:
    """A fake clock, process CPU clock and idle counter, stepped by `step(wall, cores_got, idle_cores)`."""

    def __init__(self, monkeypatch):
        self.wall = self.cpu = self.idle = 0.0
        monkeypatch.setattr(threads, "perf_counter", lambda: self.wall)
        monkeypatch.setattr(threads, "process_time", lambda: self.cpu)

    def step(self, governor: StepThreads, wall: float, cores_got: float, idle_cores: float = 0.0) -> int:
        with governor:
            self.wall += wall
            self.cpu += wall * cores_got
            self.idle += wall * idle_cores
        return torch.get_num_threads()


def test_step_threads_drop_on_a_busy_machine_come_back_on_a_quiet_one_and_wait_longer_after_a_failed_try(
        monkeypatch):
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    machine = Machine(monkeypatch)
    governor = StepThreads(idle=lambda: machine.idle)
    try:
        assert machine.step(governor, 0.3, 2.0) == 2  # quiet
        assert machine.step(governor, 0.3, 1.0) == 1  # two busy processes beside: one thread
        assert machine.step(governor, 0.3, 1.0, idle_cores=0.0) == 1
        assert machine.step(governor, 0.3, 1.0, idle_cores=1.0) == 2  # a core idle again
        assert machine.step(governor, 0.3, 1.1) == 1  # the try failed: the next waits twice as long
        assert machine.step(governor, 0.3, 1.0, idle_cores=1.0) == 1
        assert machine.step(governor, 0.3, 1.0, idle_cores=1.0) == 2
        governor.close()
        assert torch.get_num_threads() == 2
        machine.step(governor, 0.3, 1.0)
        assert (torch.get_num_threads(), governor.now) == (1, 1)
        governor.close()  # the caller's count back after a decode, the settled one kept for the next
        assert (torch.get_num_threads(), governor.now) == (2, 1)
        assert machine.step(governor, 0.01, 1.0) == 1  # the next decode starts where the last one left off
        assert governor.changes == [1, 2, 1, 2, 1, 1]
    finally:
        governor.close()
        torch.set_num_threads(before)


def test_steps_shorter_than_a_window_are_summed_before_a_decision(monkeypatch):
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    machine = Machine(monkeypatch)
    governor = StepThreads(idle=lambda: machine.idle)
    try:
        for _ in range(int(threads.WINDOW_S / 0.01) - 1):
            assert machine.step(governor, 0.01, 1.0) == 2
        assert machine.step(governor, 0.02, 1.0) == 1
    finally:
        governor.close()
        torch.set_num_threads(before)


def test_idle_seconds_reads_this_machine():
    first = idle_seconds()
    if first is None:
        pytest.skip("no /proc/stat here: the thread count stays as set")
    assert first >= 0 and idle_seconds() >= first
    assert idle_seconds("/nonexistent/stat") is None
