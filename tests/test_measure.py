"""Memory measurement: the NVML sampler against a scripted fake `pynvml`, and what a CPU run records."""

from __future__ import annotations

import sys
import time
import types

import torch

from kvbench.measure import Sampler, open_nvml, tracing
from kvbench.policies import build_policy
from kvbench.runner import evaluate
from kvbench.session import RunSettings
from kvbench.tasks import build_task

GiB = 2**30


def fake_pynvml(series: list[int]) -> tuple[types.ModuleType, dict[str, int]]:
    """A module with pynvml's function names whose memory readings follow `series` (then stay at its last)."""
    calls = {"memory": 0, "init": 0, "shutdown": 0}
    module = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    def memory(handle):
        value = series[min(calls["memory"], len(series) - 1)]
        calls["memory"] += 1
        return types.SimpleNamespace(used=value, total=80 * GiB, free=80 * GiB - value)

    module.NVMLError = NVMLError
    module.nvmlInit = lambda: calls.__setitem__("init", calls["init"] + 1)
    module.nvmlShutdown = lambda: calls.__setitem__("shutdown", calls["shutdown"] + 1)
    module.nvmlDeviceGetHandleByIndex = lambda index: f"gpu{index}"
    module.nvmlDeviceGetMemoryInfo = memory
    module.nvmlDeviceGetUtilizationRates = lambda handle: types.SimpleNamespace(gpu=87, memory=40)
    module.nvmlDeviceGetPowerUsage = lambda handle: 312_500  # milliwatts
    return module, calls


def test_sampler_peak_rate_and_stop(monkeypatch):
    series = [1 * GiB, 3 * GiB, 7 * GiB, 5 * GiB, 2 * GiB]
    module, calls = fake_pynvml(series)
    monkeypatch.setitem(sys.modules, "pynvml", module)
    nvml, note = open_nvml(torch.device("cuda", 1))
    assert note is None and nvml.handle == "gpu1" and nvml.read() == (1 * GiB, 87, 312.5)
    sampler = Sampler(nvml.read, rate_hz=200, keep=True).start()
    time.sleep(0.25)
    sampler.stop()
    taken = calls["memory"]
    assert sampler.peak == 7 * GiB  # the spike in the middle, not the last reading
    assert 0.25 * 200 * 0.4 <= len(sampler.series) <= 0.25 * 200 * 1.5 + 3  # about the rate asked for
    assert [row[1] for row in sampler.series[:4]] == series[1:5]
    assert all(b[0] >= a[0] for a, b in zip(sampler.series, sampler.series[1:], strict=False))
    time.sleep(0.05)
    assert calls["memory"] == taken  # stopped means stopped
    nvml.close()
    assert calls == {"memory": taken, "init": 1, "shutdown": 1}


def test_without_nvml_or_gpu_the_record_says_what_it_could_not_measure(tiny_llama, monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails
    assert open_nvml(torch.device("cuda", 0)) == (None, "nvidia-ml-py is not installed (pip install 'kvbench[gpu]')")
    assert open_nvml(torch.device("cpu")) == (None, "no GPU")
    task = build_task("niah", {"depths": [0.5]})
    sample = task.samples(tiny_llama.tokenizer, 300, 1, 0)[0]
    with tracing() as traces:
        record = evaluate(tiny_llama, task, build_policy("window"), sample, RunSettings(budget=64), 300, 0)
    assert record["mem_peak_device"] is None and record["mem_peak_reserved"] is None
    assert record["mem_device_note"] == "no GPU"
    assert record["mem_peak_alloc"] >= record["mem_baseline"] > 0  # process RSS on CPU
    assert len(traces) == 1 and traces[0]["columns"] == ["seconds", "bytes"] and len(traces[0]["rows"]) >= 2
