"""GPU utilisation, memory and power from NVML (nvidia-ml-py), as Prometheus families at scrape time.

On a machine without an NVIDIA driver or without nvidia-ml-py installed there is nothing to
report and no family is emitted (the engines' busy fraction, tokenyard_engine_busy_seconds, is the
utilisation figure everywhere). NVML is initialised once, on the first scrape; a failure is
remembered, so a CPU host pays for the attempt once.
"""
from __future__ import annotations

import logging
from typing import Any, Iterable

from prometheus_client.core import GaugeMetricFamily

log = logging.getLogger(__name__)
NAMES = ("tokenyard_gpu_utilization_ratio", "tokenyard_gpu_memory_used_bytes", "tokenyard_gpu_memory_total_bytes",
         "tokenyard_gpu_power_watts")
_nvml: Any = None        # the module once initialised; False: unavailable


def _init() -> Any:
    global _nvml
    if _nvml is None:
        try:
            import pynvml  # nvidia-ml-py
            pynvml.nvmlInit()
            _nvml = pynvml
        except Exception as e:  # noqa: BLE001 - ImportError, NVMLError (no driver, no device): no GPU figures
            log.debug("no NVML: %s", e)
            _nvml = False
    return _nvml


def device_families() -> Iterable[GaugeMetricFamily]:
    nvml = _init()
    if not nvml:
        return []
    util = GaugeMetricFamily(NAMES[0], "Share of the last sample period a kernel ran on the GPU (NVML)", labels=["gpu"])
    used = GaugeMetricFamily(NAMES[1], "GPU memory in use (NVML)", labels=["gpu"])
    total = GaugeMetricFamily(NAMES[2], "GPU memory in all (NVML)", labels=["gpu"])
    power = GaugeMetricFamily(NAMES[3], "GPU power draw (NVML)", labels=["gpu"])
    try:
        for i in range(nvml.nvmlDeviceGetCount()):
            h = nvml.nvmlDeviceGetHandleByIndex(i)
            rates = nvml.nvmlDeviceGetUtilizationRates(h)
            mem = nvml.nvmlDeviceGetMemoryInfo(h)
            util.add_metric([str(i)], rates.gpu / 100.0)
            used.add_metric([str(i)], float(mem.used))
            total.add_metric([str(i)], float(mem.total))
            power.add_metric([str(i)], nvml.nvmlDeviceGetPowerUsage(h) / 1000.0)
    except Exception as e:  # noqa: BLE001 - a device that stops answering must not break the scrape
        log.warning("NVML read failed: %s", e)
    return [util, used, total, power]
