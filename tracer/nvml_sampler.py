"""GPU health from NVML, sampled on a daemon thread into the gpu table.

Each metric is read on its own and left NaN (or -1 for counters) when the device does not support it,
so one missing counter never costs the others. Without pynvml, a driver or a CUDA device the sampler
switches itself off with one log line. NVLink throughput comes from NVML's cumulative per-link data
counters (field values, summed over links), differenced between samples.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Any, Callable

import torch

log = logging.getLogger("megascope.tracer")

_NAN = math.nan


def _nvml_handle(nvml: Any, device: torch.device) -> Any:
    """The NVML handle of a torch device, by UUID (respects CUDA_VISIBLE_DEVICES), else by index."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    try:
        uuid = str(torch.cuda.get_device_properties(index).uuid)
        return nvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
    except Exception:
        return nvml.nvmlDeviceGetHandleByIndex(index)


class NvmlSampler:
    def __init__(self, device: torch.device, emit: Callable[[tuple], None], now_ns: Callable[[], int],
                 interval_s: float) -> None:
        self.emit = emit
        self.now_ns = now_ns
        self.interval_s = max(0.05, interval_s)
        self.samples = 0
        self._nvml: Any = None
        self._stop = threading.Event()
        self._nvlink_prev: tuple[float, float, float] | None = None
        self._thread: threading.Thread | None = None
        if device.type != "cuda":
            log.info("tracer: NVML sampling off (device %s is not a GPU)", device)
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            self._handle = _nvml_handle(pynvml, device)
            self._nvml = pynvml
        except Exception as exc:
            log.info("tracer: NVML sampling off (%r)", exc)
            return
        self._thread = threading.Thread(target=self._run, name="megascope-nvml", daemon=True)
        self._thread.start()

    @property
    def active(self) -> bool:
        return self._thread is not None

    def _read(self, fn: Callable[[], Any], default: Any = _NAN) -> Any:
        try:
            return fn()
        except Exception:  # NVMLError_NotSupported and friends: this metric only
            return default

    def sample(self) -> tuple:
        nvml, h = self._nvml, self._handle
        util = self._read(lambda: nvml.nvmlDeviceGetUtilizationRates(h), None)
        mem = self._read(lambda: nvml.nvmlDeviceGetMemoryInfo(h), None)
        reasons_fn = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
            nvml.nvmlDeviceGetCurrentClocksThrottleReasons
        nvlink_tx, nvlink_rx = self._nvlink_rates()
        return (
            self.now_ns(),
            float(util.gpu) if util is not None else _NAN,
            float(util.memory) if util is not None else _NAN,
            int(mem.used) if mem is not None else -1,
            self._read(lambda: nvml.nvmlDeviceGetPowerUsage(h) / 1000.0),
            self._read(lambda: float(nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU))),
            self._read(lambda: float(nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_SM))),
            self._read(lambda: int(reasons_fn(h)), -1),
            self._read(lambda: int(nvml.nvmlDeviceGetTotalEccErrors(
                h, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC)), -1),
            self._read(lambda: float(nvml.nvmlDeviceGetPcieThroughput(h, nvml.NVML_PCIE_UTIL_TX_BYTES))),
            self._read(lambda: float(nvml.nvmlDeviceGetPcieThroughput(h, nvml.NVML_PCIE_UTIL_RX_BYTES))),
            nvlink_tx, nvlink_rx,
        )

    def _nvlink_rates(self) -> tuple[float, float]:
        """KB/s over all links since the previous sample, from cumulative KiB counters."""
        nvml = self._nvml
        try:
            links = range(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18))
            ids = [(field, link) for field in (nvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX,
                                               nvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX) for link in links]
            values = nvml.nvmlDeviceGetFieldValues(self._handle, ids)
            ok = [(ids[i][0], v.value.ullVal) for i, v in enumerate(values) if v.nvmlReturn == 0]
            if not ok:
                return _NAN, _NAN
            tx = float(sum(val for field, val in ok if field == nvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX))
            rx = float(sum(val for field, val in ok if field == nvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX))
        except Exception:
            return _NAN, _NAN
        now = time.monotonic()
        prev, self._nvlink_prev = self._nvlink_prev, (now, tx, rx)
        if prev is None or now <= prev[0]:
            return _NAN, _NAN
        dt = now - prev[0]
        return (tx - prev[1]) * 1.024 / dt, (rx - prev[2]) * 1.024 / dt

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.emit(self.sample())
                self.samples += 1
            except Exception as exc:
                log.warning("tracer: NVML sample failed, sampling off: %r", exc)
                return

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
            try:
                self._nvml.nvmlShutdown()
            except Exception:
                pass
