"""The per-op bench's timing on the CPU (lmkernels.harness.bench.measure): the alternating GPU
timing and the launch probe with their CUDA calls replaced, and compile_naive's loss."""

from __future__ import annotations

import importlib
import time

import pytest
import torch


class _Event:
    """torch.cuda.Event's part that _queued_call_ms uses, on the CPU."""

    def __init__(self, enable_timing=False):
        self.t = 0.0

    def record(self):
        self.t = time.perf_counter()

    def synchronize(self):
        pass

    def elapsed_time(self, end):
        return (end.t - self.t) * 1e3


def test_interleaved_timing_alternates_every_variant_behind_the_same_sleep(monkeypatch):
    """interleaved_gpu_ms's order, sleep and gradients, its CUDA calls replaced on the CPU."""
    measure = importlib.import_module("lmkernels.harness.bench.measure")  # the module, not the function

    sleeps, calls = [], []
    hosts = {"a": 2.0, "b": 5.0, "c": 1.0}
    params = {n: torch.zeros(3, requires_grad=True) for n in "abc"}
    monkeypatch.setattr(measure, "_l2_flush_buffer", lambda: torch.zeros(4))
    monkeypatch.setattr(measure, "_sleep_cycles_per_ms", lambda: 1000.0)
    monkeypatch.setattr(measure, "once_ms", lambda run, device: (0.0, hosts[run()]))
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "_sleep", sleeps.append)

    def call(name):
        # No other variant's gradients live during a call, whatever ran before it.
        assert all(params[n].grad is None for n in params if n != name)
        params[name].grad = torch.ones(3)
        calls.append(name)
        time.sleep({"a": 0.001, "b": 0.003, "c": 0.005}[name])
        return name

    # Launch ms behind the detection sleep (2 x b's 5 ms + 20 ms); b waits for the GPU (None).
    launch = {"a": 1.5, "b": None, "c": 3.0}
    launch_cycles = []

    def launch_ms(run, grad_tensors, cycles):
        launch_cycles.append(cycles)
        name = run()
        grad_tensors[0].grad = None
        return launch[name]

    monkeypatch.setattr(measure, "_launch_ms", launch_ms)
    runs = {n: (lambda n=n: call(n), [params[n]]) for n in "abc"}
    got, sleep_ms, waits = measure.interleaved_gpu_ms(runs, 4)
    assert calls[9:] == list("abccbaabccba")  # after a warm-up, once_ms's and the queued call
    assert launch_cycles == [int(1000 * (2 * 5.0 + 20))] * 3
    assert waits == {"b"}
    # The slowest launch of those that do not wait (c's 3 ms), for all.
    assert set(sleeps) == {int(1000 * (1.5 * 3.0 + 0.2))} and len(sleeps) == 12
    assert sleep_ms == pytest.approx(4.7, abs=1e-3)
    assert got["a"] < got["b"] < got["c"]
    assert all(p.grad is None for p in params.values())

    launch = {"a": None, "b": None, "c": None}  # all wait: the shortest sleep
    got, sleep_ms, waits = measure.interleaved_gpu_ms(runs, 2)
    assert waits == {"a", "b", "c"} and sleep_ms == pytest.approx(0.2, abs=1e-3)

    # A launch past MAX_COVERED_LAUNCH_MS is not covered: counted as waiting, the sleep set by
    # the others.
    launch = {"a": 1.5, "b": measure.MAX_COVERED_LAUNCH_MS + 1, "c": 3.0}
    got, sleep_ms, waits = measure.interleaved_gpu_ms(runs, 2)
    assert waits == {"b"} and sleep_ms == pytest.approx(4.7, abs=1e-3)


def test_launch_ms_says_whether_the_call_waited(monkeypatch):
    """_launch_ms: the host time of a call queued behind a sleep, or None where the sleep had
    ended by the time the call returned (its CUDA calls replaced on the CPU)."""
    measure = importlib.import_module("lmkernels.harness.bench.measure")
    ended = {"value": False}

    class Slept:
        def record(self):
            pass

        def query(self):
            return ended["value"]

    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: None)
    monkeypatch.setattr(torch.cuda, "Event", Slept)
    param = torch.zeros(2, requires_grad=True)

    def run():
        param.grad = torch.ones(2)

    assert measure._launch_ms(run, [param], 100) >= 0 and param.grad is None
    ended["value"] = True  # a call that read a device value back: the sleep is over
    assert measure._launch_ms(run, [param], 100) is None and param.grad is None


def test_compile_naive_computes_the_loss_with_softcap():
    import torch

    from lmkernels.harness.bench import naive_flce
    from lmkernels.registry.core import get_op

    spec = get_op("fused_linear_cross_entropy")
    x = spec.make_inputs({"BT": 37, "H": 64, "V": 131}, torch.float32, "cpu", 0, softcap=5.0, regime="zipf")
    want = spec.reference(**x)
    got = naive_flce(x["hidden"], x["weight"], x["target"], softcap=5.0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
