"""Timing and peak-memory measurement around one sample.

Memory is measured three ways, because they answer different questions:
  allocator - torch's CUDA allocator peak (allocated, and reserved by its caching), reset per sample;
  device    - the GPU's memory in use as NVML sees it (what OOMs: includes the CUDA context, other
              processes, fragmentation), sampled by a background thread at `rate_hz`;
  process   - on CPU, the resident set size, sampled the same way.
Each measure that cannot be taken (no GPU, no `nvidia-ml-py`) is None, with a note saying why.

A model placed over several GPUs (`device_map`) is measured over all of them: every function here takes the
model's devices (one device, or a sequence of them). Its GPU peaks are sums over the devices of each device's own
peak. The devices may peak at different moments (each while its own layers run), so that sum can exceed the most
the GPUs ever held together: it is what they must have between them, each device holding its own peak.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any, cast

import psutil
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

# a list that every PeakMemory appends its time series to, while `tracing()` is active
_TRACES: contextvars.ContextVar[list | None] = contextvars.ContextVar("kvbench_traces", default=None)

# one device, or every device a model is placed on (`LoadedModel.devices`)
Devices = torch.device | Sequence[torch.device]


def cuda_devices(devices: Devices) -> list[torch.device]:
    """The distinct CUDA devices among `devices`, in order, each with its index (`cuda` alone is the current one)."""
    listed = [devices] if isinstance(devices, torch.device) else devices
    return list(dict.fromkeys(torch.device("cuda", torch.cuda.current_device()) if d.index is None else d
                              for d in listed if d.type == "cuda"))


def synchronize(devices: Devices) -> None:
    """Wait for the work queued on every CUDA device among `devices` (a layer on cuda:1 may still be running
    when cuda:0 is done)."""
    for device in cuda_devices(devices):
        torch.cuda.synchronize(device)


class Stopwatch:
    """Wall-clock seconds between marks synchronized on every device."""

    def __init__(self, devices: Devices) -> None:
        self.devices = cuda_devices(devices)
        synchronize(self.devices)
        self.last = time.perf_counter()

    def lap(self) -> float:
        synchronize(self.devices)
        now = time.perf_counter()
        elapsed, self.last = now - self.last, now
        return elapsed


class Sampler:
    """A background thread calling `read()` every 1/`rate_hz` seconds between start and stop; keeps the
    peak of its first value and, when `keep`, the whole series as (seconds, *values)."""

    def __init__(self, read, rate_hz: float, keep: bool = False) -> None:
        self.read = read
        self.interval_s = 1.0 / rate_hz
        self.keep = keep
        self.peak: float | None = None
        self.series: list[tuple[float, ...]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def start(self) -> Sampler:
        self._start = time.perf_counter()
        self._take()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self._take()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._take()

    def _take(self) -> None:
        values = self.read()
        self.peak = values[0] if self.peak is None else max(self.peak, values[0])
        if self.keep:
            self.series.append((round(time.perf_counter() - self._start, 6), *values))


class DeviceUnmeasured(Exception):
    """NVML cannot measure a device's own memory; the message says why (it becomes `mem_device_note`)."""


def nvml_handle(nvml: Any, device: torch.device) -> Any:
    """NVML's handle of the CUDA device `device`. Never by torch's index: NVML numbers every GPU of the machine
    in PCI order, CUDA only those CUDA_VISIBLE_DEVICES lists, in its order (and by default fastest first), so
    cuda:0 may be NVML's GPU 3. The device is found by the UUID CUDA reports for it, else by its PCI bus id.
    On a MIG slice CUDA reports the slice's UUID ("MIG-..." to NVML), whose handle measures the slice alone;
    where NVML finds only the parent GPU with MIG on, its memory counts every instance: DeviceUnmeasured."""
    properties = torch.cuda.get_device_properties(device)
    uuid = str(getattr(properties, "uuid", "") or "")  # torch prints CUDA's UUID without NVML's prefix
    names = [uuid] if uuid.startswith(("GPU-", "MIG-")) else [f"GPU-{uuid}", f"MIG-{uuid}"] if uuid else []
    for name in names:
        try:
            handle = nvml.nvmlDeviceGetHandleByUUID(name)
        except nvml.NVMLError:
            continue
        if name.startswith("MIG-"):
            return handle
        return _whole_gpu(nvml, handle, device, name)
    bus_id = _pci_bus_id(properties)
    if bus_id is not None:
        try:
            handle = nvml.nvmlDeviceGetHandleByPciBusId(bus_id)  # nvidia-ml-py calls NVML's _v2 of it
        except nvml.NVMLError:
            pass
        else:
            return _whole_gpu(nvml, handle, device, f"PCI bus id {bus_id}")
    raise DeviceUnmeasured(f"NVML has no GPU with {device}'s UUID ({uuid or 'none reported'}) "
                           f"or PCI bus id ({bus_id or 'none reported'})")


def _pci_bus_id(properties: Any) -> str | None:
    """The device's PCI address as NVML writes it (domain:bus:device.function), or None where torch omits it."""
    parts = [getattr(properties, name, None) for name in ("pci_domain_id", "pci_bus_id", "pci_device_id")]
    if None in parts:
        return None
    domain, bus, slot = parts
    return f"{domain:08X}:{bus:02X}:{slot:02X}.0"


def _whole_gpu(nvml: Any, handle: Any, device: torch.device, found_by: str) -> Any:
    """`handle`, a physical GPU's, unless MIG is on there: then `device` is one of its slices and the GPU's
    memory in use counts every instance."""
    try:
        mig_on = nvml.nvmlDeviceGetMigMode(handle)[0] == nvml.NVML_DEVICE_MIG_ENABLE
    except nvml.NVMLError:  # NOT_SUPPORTED: a GPU without MIG
        mig_on = False
    if mig_on:
        raise DeviceUnmeasured(f"{device} is a MIG slice but NVML finds only its whole GPU ({found_by}), whose "
                               f"memory counts every MIG instance: no device peak (the allocator's still holds)")
    return handle


class Nvml:
    """Memory in use, utilization and power of CUDA devices through NVML (`nvidia-ml-py`, imported lazily),
    each device's handle found by `nvml_handle`; keeps each device's peak of memory in use over its readings."""

    def __init__(self, devices: Sequence[torch.device]) -> None:
        import pynvml

        self.nvml = pynvml
        pynvml.nvmlInit()
        try:
            self.handles = [nvml_handle(pynvml, device) for device in devices]
        except BaseException:
            pynvml.nvmlShutdown()
            raise
        self.peaks = [0] * len(self.handles)

    @property
    def peak_used(self) -> int:
        """The sum over the devices of each one's peak memory in use (see the module docstring)."""
        return sum(self.peaks)

    def read(self) -> tuple[int, float | None, float | None]:
        """(bytes used, GPU utilization %, power W) over the devices: bytes and watts summed, utilization their
        mean; None where a device does not report it (a MIG slice has no utilization of its own)."""
        used = [self.nvml.nvmlDeviceGetMemoryInfo(handle).used for handle in self.handles]
        self.peaks = [max(peak, value) for peak, value in zip(self.peaks, used, strict=True)]
        utilization = [self._optional(self.nvml.nvmlDeviceGetUtilizationRates, h) for h in self.handles]
        power = [self._optional(self.nvml.nvmlDeviceGetPowerUsage, h) for h in self.handles]
        return (sum(used),
                None if None in utilization else sum(u.gpu for u in utilization) / len(utilization),
                None if None in power else sum(power) / 1000)  # milliwatts

    def _optional(self, query, handle) -> Any:
        try:
            return query(handle)
        except self.nvml.NVMLError:
            return None

    def close(self) -> None:
        self.nvml.nvmlShutdown()


def open_nvml(devices: Devices) -> tuple[Nvml | None, str | None]:
    """NVML for the CUDA devices among `devices`, or None and the reason it is unavailable."""
    cuda = cuda_devices(devices)
    if not cuda:
        return None, "no GPU"
    try:
        return Nvml(cuda), None
    except ImportError:
        return None, "nvidia-ml-py is not installed (pip install -e '.[gpu]' in the kvbench checkout)"
    except DeviceUnmeasured as exc:
        return None, str(exc)
    except Exception as exc:  # NVMLError_LibraryNotFound, driver mismatch, ...
        return None, f"NVML unavailable: {exc}"


@contextlib.contextmanager
def memory_pressure(devices: Devices, pressure: float | None = None,
                    limit_bytes: int | None = None) -> Iterator[int | None]:
    """Run the block as if `pressure` of each device's memory were taken by others (or with `limit_bytes` on each
    device, as if every GPU had that much). On GPUs each device's allocator is capped
    (`set_per_process_memory_fraction`), so weights, activations and cache meet the limit where they would on a
    fuller GPU; yields None. On CPU the limit applies to the KV cache's bytes (a share of the RAM available
    now); yields those bytes."""
    def allowed(total: int) -> float:
        if limit_bytes is not None:
            return limit_bytes
        if pressure is None:
            raise ValueError("memory_pressure needs a pressure or limit_bytes")
        return (1 - pressure) * total

    cuda = cuda_devices(devices)
    if cuda:
        # the cap bounds what the allocator reserves: blocks it cached before would let the block allocate past it
        torch.cuda.empty_cache()
        for device in cuda:
            total = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, allowed(total) / total), device)
        try:
            yield None
        finally:
            torch.cuda.empty_cache()  # every device's cache (the allocator empties them all)
            for device in cuda:
                torch.cuda.set_per_process_memory_fraction(1.0, device)
        return
    yield int(allowed(psutil.virtual_memory().available))


@contextlib.contextmanager
def tracing() -> Iterator[list[dict[str, Any]]]:
    """Collect the memory time series of every sample measured inside the block."""
    traces: list[dict[str, Any]] = []
    token = _TRACES.set(traces)
    try:
        yield traces
    finally:
        _TRACES.reset(token)


class PeakMemory:
    """Peak memory over a `with` block (see the module docstring): `peak_bytes` is the allocator's peak on the
    GPUs (summed over the devices, each one's own), else the process RSS peak; `peak_reserved` and `peak_device`
    are None where unmeasurable. Each `peak_*` has its `baseline_*`: the same measure as the block began."""

    def __init__(self, devices: Devices, rate_hz: float = 100.0) -> None:
        self.devices = devices
        self.rate_hz = rate_hz
        self.peak_bytes = 0
        self.baseline_bytes = 0
        self.peak_reserved: int | None = None
        self.baseline_reserved: int | None = None
        self.peak_device: int | None = None
        self.baseline_device: int | None = None
        self.device_note: str | None = None
        self._process = psutil.Process()

    def __enter__(self) -> PeakMemory:
        traces = _TRACES.get()
        self._cuda = cuda_devices(self.devices)
        if self._cuda:
            synchronize(self._cuda)
            for device in self._cuda:
                torch.cuda.reset_peak_memory_stats(device)
            self.baseline_bytes = self._allocated()
            self.baseline_reserved = sum(torch.cuda.memory_reserved(device) for device in self._cuda)
            self._nvml, self.device_note = open_nvml(self._cuda)
            if self._nvml:
                self.baseline_device = self._nvml.read()[0]
            read = self._nvml.read if self._nvml else lambda: (self._allocated(),)
        else:
            self._nvml, self.device_note = None, "no GPU"
            self.baseline_bytes = self._process.memory_info().rss
            read = lambda: (self._process.memory_info().rss,)  # noqa: E731
        # on a GPU without NVML the allocator's own peak is exact: sample only for a trace
        needed = not self._cuda or self._nvml is not None or traces is not None
        self._sampler = Sampler(read, self.rate_hz, keep=traces is not None).start() if needed else None
        return self

    def _allocated(self) -> int:
        return sum(torch.cuda.memory_allocated(device) for device in self._cuda)

    def __exit__(self, *exc) -> None:
        if self._sampler:
            self._sampler.stop()
        if self._cuda:
            synchronize(self._cuda)
            self.peak_bytes = sum(torch.cuda.max_memory_allocated(device) for device in self._cuda)
            self.peak_reserved = sum(torch.cuda.max_memory_reserved(device) for device in self._cuda)
            if self._nvml:
                self.peak_device = self._nvml.peak_used
                self._nvml.close()
        else:
            assert self._sampler is not None and self._sampler.peak is not None  # on CPU it always runs
            self.peak_bytes = int(self._sampler.peak)
        traces = _TRACES.get()
        if traces is not None and self._sampler:
            columns = ["seconds", "device_used", "gpu_util", "power_w"] if self._nvml else ["seconds", "bytes"]
            traces.append({"columns": columns, "rows": self._sampler.series})


# Python's reads of a tensor's value, and the aten ops that hand one to the host: each makes the host wait for the
# device's queue to drain
HOST_READS = frozenset({"tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__index__", "__float__", "__array__"})
SYNCING_OPS = frozenset({"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.masked_select.default"})


class StepWork(TorchDispatchMode):
    """What the code run inside `with StepWork() as work:` asks of the device: `ops`, the aten ops dispatched, and
    `syncs`, each read of a device value by the host, by name (counted, so it does not depend on the machine)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.syncs: collections.Counter[str] = collections.Counter()
        self._reads = _HostReads(self.syncs)

    def __enter__(self) -> StepWork:
        self._reads.__enter__()
        return cast(StepWork, super().__enter__())

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        self._reads.__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops += 1
        if str(func) in SYNCING_OPS:
            self.syncs[str(func)] += 1
        return func(*args, **(kwargs or {}))


class _HostReads(TorchFunctionMode):
    """`StepWork`'s reads of tensor values from Python, before they reach the dispatcher."""

    def __init__(self, reads: collections.Counter[str]) -> None:
        super().__init__()
        self.reads = reads

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if getattr(func, "__name__", "") in HOST_READS:
            self.reads[func.__name__] += 1
        return func(*args, **(kwargs or {}))
