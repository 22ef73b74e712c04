"""Memory measurement: the NVML sampler against a scripted fake `pynvml`, the CUDA paths against a fake `torch.cuda`
(devices found by UUID, MIG slices, a model over several GPUs), and what a CPU run records."""

from __future__ import annotations

import sys
import time
import types
from dataclasses import dataclass, field

import pytest
import torch

from kvbench.engine.instruments import PeakMemory, Sampler, Stopwatch, memory_pressure, open_nvml, tracing
from kvbench.engine.models import LoadedModel
from kvbench.engine.settings import RunSettings
from kvbench.policies import build_policy
from kvbench.runs.runner import evaluate
from kvbench.tasks import build_task

GiB = 2**30
CUDA0, CUDA1 = torch.device("cuda", 0), torch.device("cuda", 1)


@dataclass(eq=False)
class FakeGpu:
    """One GPU (or MIG slice) as NVML sees it; the object itself is its handle."""

    uuid: str  # NVML's, with its GPU- or MIG- prefix
    bus_id: str | None = None  # NVML's "%08X:%02X:%02X.0"; a MIG slice has none of its own
    used: list[int] = field(default_factory=lambda: [1 * GiB])  # readings in turn, then the last one again
    mig_on: bool = False
    utilization: int | None = 87  # None: NOT_SUPPORTED, as on a MIG slice
    reads: int = 0


def fake_pynvml(gpus: list[FakeGpu]) -> tuple[types.ModuleType, dict[str, int]]:
    """A module with pynvml's names over `gpus`, listed in NVML's (physical) order; counts init and shutdown."""
    calls = {"init": 0, "shutdown": 0}
    module = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    def find(matches):
        found = [gpu for gpu in gpus if matches(gpu)]
        if not found:
            raise NVMLError("Not Found")
        return found[0]

    def memory(gpu):
        value = gpu.used[min(gpu.reads, len(gpu.used) - 1)]
        gpu.reads += 1
        return types.SimpleNamespace(used=value, total=80 * GiB, free=80 * GiB - value)

    def utilization(gpu):
        if gpu.utilization is None:
            raise NVMLError("Not Supported")
        return types.SimpleNamespace(gpu=gpu.utilization, memory=40)

    def mig_mode(gpu):
        if gpu.uuid.startswith("MIG-"):
            raise NVMLError("Not Supported")
        return [int(gpu.mig_on), int(gpu.mig_on)]

    module.NVMLError = NVMLError
    module.NVML_DEVICE_MIG_ENABLE = 1
    module.nvmlInit = lambda: calls.__setitem__("init", calls["init"] + 1)
    module.nvmlShutdown = lambda: calls.__setitem__("shutdown", calls["shutdown"] + 1)
    module.nvmlDeviceGetHandleByIndex = lambda index: [g for g in gpus if g.bus_id][index]  # what must not be used
    module.nvmlDeviceGetHandleByUUID = lambda uuid: find(lambda gpu: gpu.uuid == uuid)
    module.nvmlDeviceGetHandleByPciBusId = lambda bus_id: find(lambda gpu: gpu.bus_id == bus_id)
    module.nvmlDeviceGetMigMode = mig_mode
    module.nvmlDeviceGetMemoryInfo = memory
    module.nvmlDeviceGetUtilizationRates = utilization
    module.nvmlDeviceGetPowerUsage = lambda gpu: 312_500  # milliwatts
    return module, calls


class FakeCuda:
    """torch.cuda's device calls over fake devices (torch's index -> its properties), each call logged."""

    def __init__(self, properties: dict[int, types.SimpleNamespace]) -> None:
        self.properties = properties
        self.allocated = dict.fromkeys(properties, 0)
        self.peak = dict.fromkeys(properties, 0)
        self.reserved_peak = dict.fromkeys(properties, 0)
        self.log: list[tuple] = []

    def install(self, monkeypatch) -> FakeCuda:
        for name in ("synchronize", "reset_peak_memory_stats", "memory_allocated", "max_memory_allocated",
                     "memory_reserved", "max_memory_reserved", "get_device_properties",
                     "set_per_process_memory_fraction", "empty_cache", "current_device"):
            monkeypatch.setattr(torch.cuda, name, getattr(self, name))
        return self

    def allocate(self, index: int, size: int) -> None:
        self.allocated[index] += size
        self.peak[index] = max(self.peak[index], self.allocated[index])
        self.reserved_peak[index] = max(self.reserved_peak[index], self.allocated[index] + GiB)

    def synchronize(self, device):
        self.log.append(("synchronize", device.index))

    def reset_peak_memory_stats(self, device):
        self.log.append(("reset", device.index))
        self.peak[device.index] = self.allocated[device.index]
        self.reserved_peak[device.index] = self.memory_reserved(device)

    def memory_allocated(self, device):
        return self.allocated[device.index]

    def max_memory_allocated(self, device):
        return self.peak[device.index]

    def memory_reserved(self, device):
        return self.allocated[device.index] + GiB

    def max_memory_reserved(self, device):
        return self.reserved_peak[device.index]

    def get_device_properties(self, device):
        return self.properties[device.index]

    def set_per_process_memory_fraction(self, fraction, device):
        self.log.append(("fraction", device.index, fraction))

    def empty_cache(self):
        self.log.append(("empty_cache",))

    def current_device(self):
        return 0


def properties(uuid: str | None = None, pci: tuple[int, int, int] | None = None, total: int = 80 * GiB):
    """What torch.cuda.get_device_properties gives: the UUID without NVML's prefix, PCI domain/bus/device ids."""
    fields = {"total_memory": total, **({"uuid": uuid} if uuid else {})}
    if pci:
        fields.update(pci_domain_id=pci[0], pci_bus_id=pci[1], pci_device_id=pci[2])
    return types.SimpleNamespace(**fields)


def machine(count: int = 4) -> list[FakeGpu]:
    """`count` physical GPUs in NVML's order, GPU i at PCI bus 0x10 + i."""
    return [FakeGpu(f"GPU-{i}000-aaaa", f"00000000:{0x10 + i:02X}:00.0", [(i + 1) * GiB]) for i in range(count)]


def test_sampler_peak_rate_and_stop(monkeypatch):
    gpu = FakeGpu("GPU-1111", used=[1 * GiB, 3 * GiB, 7 * GiB, 5 * GiB, 2 * GiB])
    module, calls = fake_pynvml([gpu])
    monkeypatch.setitem(sys.modules, "pynvml", module)
    FakeCuda({1: properties("1111")}).install(monkeypatch)
    nvml, note = open_nvml(CUDA1)
    assert note is None and nvml.handles == [gpu] and nvml.read() == (1 * GiB, 87, 312.5)
    sampler = Sampler(nvml.read, rate_hz=200, keep=True).start()
    time.sleep(0.25)
    sampler.stop()
    taken = gpu.reads
    assert sampler.peak == 7 * GiB  # the spike in the middle, not the last reading
    assert 0.25 * 200 * 0.4 <= len(sampler.series) <= 0.25 * 200 * 1.5 + 3  # about the rate asked for
    assert [row[1] for row in sampler.series[:4]] == gpu.used[1:5]
    assert all(b[0] >= a[0] for a, b in zip(sampler.series, sampler.series[1:], strict=False))
    time.sleep(0.05)
    assert gpu.reads == taken  # stopped means stopped
    nvml.close()
    assert calls == {"init": 1, "shutdown": 1}


def test_nvml_finds_each_device_by_uuid_under_a_reordering_cuda_visible_devices(monkeypatch):
    # CUDA_VISIBLE_DEVICES=3,1: torch's cuda:0 is the machine's GPU 3, cuda:1 its GPU 1
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    gpus = machine()
    module, calls = fake_pynvml(gpus)
    monkeypatch.setitem(sys.modules, "pynvml", module)
    FakeCuda({0: properties("3000-aaaa"), 1: properties("1000-aaaa")}).install(monkeypatch)
    nvml, note = open_nvml([CUDA0, CUDA1])
    assert note is None and nvml.handles == [gpus[3], gpus[1]]
    assert nvml.read()[0] == 4 * GiB + 2 * GiB
    nvml.close()
    assert calls == {"init": 1, "shutdown": 1}


def test_nvml_falls_back_to_the_pci_bus_id_without_a_uuid(monkeypatch):
    gpus = machine()
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(gpus)[0])
    FakeCuda({0: properties(pci=(0, 0x12, 0))}).install(monkeypatch)
    nvml, note = open_nvml(CUDA0)
    assert note is None and nvml.handles == [gpus[2]]


def test_nvml_measures_a_mig_slice_by_its_own_handle(monkeypatch):
    parent = FakeGpu("GPU-9999", "00000000:3B:00.0", [60 * GiB], mig_on=True)  # every instance's memory
    own = FakeGpu("MIG-5f16-8495", used=[3 * GiB], utilization=None)
    other = FakeGpu("MIG-23de-08f7", used=[9 * GiB], utilization=None)
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml([parent, other, own])[0])
    FakeCuda({0: properties("5f16-8495", pci=(0, 0x3B, 0))}).install(monkeypatch)
    nvml, note = open_nvml(CUDA0)
    assert note is None and nvml.handles == [own]
    assert nvml.read() == (3 * GiB, None, 312.5)  # a slice reports no utilization of its own


@pytest.mark.parametrize("cuda_reports", ["the parent's uuid", "only a PCI bus id"])
def test_a_mig_slice_nvml_sees_only_as_its_whole_gpu_is_noted_not_measured(monkeypatch, cuda_reports):
    parent = FakeGpu("GPU-9999", "00000000:3B:00.0", [60 * GiB], mig_on=True)
    module, calls = fake_pynvml([parent, FakeGpu("MIG-5f16-8495")])
    monkeypatch.setitem(sys.modules, "pynvml", module)
    uuid = "9999" if cuda_reports == "the parent's uuid" else None
    FakeCuda({0: properties(uuid, pci=(0, 0x3B, 0))}).install(monkeypatch)
    with PeakMemory(CUDA0) as memory:
        pass
    assert memory.peak_device is None and "MIG" in memory.device_note and "every MIG instance" in memory.device_note
    assert calls == {"init": 1, "shutdown": 1}


def test_a_device_nvml_does_not_know_is_noted(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(machine())[0])
    FakeCuda({0: properties("dead-beef", pci=(0, 0x77, 0))}).install(monkeypatch)
    assert open_nvml(CUDA0) == (None, "NVML has no GPU with cuda:0's UUID (dead-beef) or PCI bus id (00000000:77:00.0)")


def test_peaks_over_a_model_on_two_gpus_sum_each_devices_own_peak(monkeypatch):
    # NVML: cuda:0 peaks at its second reading, cuda:1 from its third on: 9 + 8 GiB, though together at most 11
    gpus = [FakeGpu("GPU-a", used=[1 * GiB, 9 * GiB, 1 * GiB]), FakeGpu("GPU-b", used=[2 * GiB, 2 * GiB, 8 * GiB])]
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(gpus)[0])
    cuda = FakeCuda({0: properties("a"), 1: properties("b")}).install(monkeypatch)
    cuda.allocate(0, 30 * GiB)  # an earlier sample's peak, gone by now: the reset forgets it
    cuda.allocate(0, -20 * GiB)
    cuda.allocate(1, 20 * GiB)
    with tracing() as traces, PeakMemory([CUDA0, CUDA1]) as memory:
        assert cuda.log == [("synchronize", 0), ("synchronize", 1), ("reset", 0), ("reset", 1)]
        cuda.allocate(0, 5 * GiB)
        cuda.allocate(0, -5 * GiB)
        cuda.allocate(1, 7 * GiB)
    assert cuda.log[-2:] == [("synchronize", 0), ("synchronize", 1)]
    assert memory.baseline_bytes == 10 * GiB + 20 * GiB and memory.baseline_reserved == 30 * GiB + 2 * GiB
    assert memory.peak_bytes == 15 * GiB + 27 * GiB and memory.peak_reserved == 16 * GiB + 28 * GiB
    assert memory.baseline_device == 3 * GiB and memory.peak_device == 17 * GiB and memory.device_note is None
    assert traces[0]["columns"] == ["seconds", "device_used", "gpu_util", "power_w"]
    assert traces[0]["rows"][0][1:] == (11 * GiB, 87, 625.0)  # the devices' bytes and watts summed


def test_a_single_device_is_still_accepted(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml([FakeGpu("GPU-a", used=[4 * GiB])])[0])
    cuda = FakeCuda({0: properties("a")}).install(monkeypatch)
    with PeakMemory(CUDA0) as memory:
        cuda.allocate(0, 2 * GiB)
    assert memory.peak_bytes == 2 * GiB and memory.peak_device == 4 * GiB
    assert cuda.log == [("synchronize", 0), ("reset", 0), ("synchronize", 0)]


def test_the_stopwatch_waits_for_every_device_once(monkeypatch):
    cuda = FakeCuda({0: properties("a"), 1: properties("b")}).install(monkeypatch)
    clock = Stopwatch([torch.device("cuda"), CUDA0, CUDA1, torch.device("cpu")])  # `cuda` is the current one, 0
    assert cuda.log == [("synchronize", 0), ("synchronize", 1)]
    clock.lap()
    assert cuda.log == [("synchronize", 0), ("synchronize", 1)] * 2


def test_memory_pressure_caps_every_device_and_lifts_every_cap(monkeypatch):
    cuda = FakeCuda({0: properties("a", total=80 * GiB), 1: properties("b", total=40 * GiB)}).install(monkeypatch)
    with memory_pressure([CUDA0, CUDA1], pressure=0.75) as kv_limit:
        # the cache emptied first: blocks cached before would let the block reserve past the cap
        assert kv_limit is None and cuda.log == [("empty_cache",), ("fraction", 0, 0.25), ("fraction", 1, 0.25)]
    assert cuda.log[3:] == [("empty_cache",), ("fraction", 0, 1.0), ("fraction", 1, 1.0)]
    cuda.log.clear()
    with memory_pressure([CUDA0, CUDA1], limit_bytes=10 * GiB):  # 10 GiB on each device
        assert cuda.log == [("empty_cache",), ("fraction", 0, 0.125), ("fraction", 1, 0.25)]


def test_a_model_placed_with_device_map_lists_every_device_it_is_on():
    def loaded(model):
        return LoadedModel(model, tokenizer=None, spec="x", device=CUDA0, dtype=torch.bfloat16, cache_arg="cache",
                           takes_cache_position=False)

    spread = {"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": 1, "model.layers.2": "disk",
              "model.norm": "cuda:2", "lm_head": "cpu"}
    assert loaded(types.SimpleNamespace(hf_device_map=spread)).devices == [
        CUDA0, CUDA1, torch.device("cuda", 2), torch.device("cpu")]
    assert loaded(types.SimpleNamespace()).devices == [CUDA0]


def test_without_nvml_or_gpu_the_record_says_what_it_could_not_measure(tiny_llama, monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails
    assert open_nvml(CUDA0) == (None, "nvidia-ml-py is not installed (pip install -e '.[gpu]' in the kvbench checkout)")
    assert open_nvml(torch.device("cpu")) == (None, "no GPU")
    assert tiny_llama.devices == [torch.device("cpu")]
    task = build_task("niah", {"depths": [0.5]})
    sample = task.samples(tiny_llama.tokenizer, 300, 1, 0)[0]
    with tracing() as traces:
        record = evaluate(tiny_llama, task, build_policy("window"), sample, RunSettings(budget=64), 300, 0)
    assert record["mem_peak_device"] is None and record["mem_peak_reserved"] is None
    assert record["mem_device_note"] == "no GPU"
    assert record["mem_peak_alloc"] >= record["mem_baseline"] > 0  # process RSS on CPU
    assert len(traces) == 1 and traces[0]["columns"] == ["seconds", "bytes"] and len(traces[0]["rows"]) >= 2
