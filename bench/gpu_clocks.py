"""The GPU's SM clock and board power over a timed window, read through NVML with ctypes (no pynvml).

    with ClockSampler(torch.cuda.current_device()) as clocks:
        ... timed steps ...
    clocks.summary()   # {"sm_mhz": mean, "power_w": mean, "power_capped": share of samples} or {}

Why the bench records them: the H200 of the device tool sits at its ~700 W software power cap
through matmul-heavy steps, and its SM clock then moves between ~1.4 and ~1.98 GHz (session 12,
bench/RESULTS.md): two runs of the same step can differ by a few percent for that alone, and a run
whose clock is *higher* at the same power did less work per cycle (idle or memory-bound time).
One sample every `interval_s` from a daemon thread: each NVML read is a few microseconds, so the
host thread that launches the step is not slowed (a `nvidia-smi` process per sample would be).
Without NVML (no NVIDIA driver, a CPU run) the summary is empty.
"""
from __future__ import annotations

import ctypes
import threading

NVML_CLOCK_SM = 1
SW_POWER_CAP = 0x4  # nvmlClocksEventReasonSwPowerCap


def _load_nvml():
    try:
        lib = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None
    return lib if lib.nvmlInit_v2() == 0 else None


class ClockSampler:
    def __init__(self, device_index: int = 0, interval_s: float = 0.05, lib=None, uuid: str | None = None):
        self.interval_s, self.samples = interval_s, []
        # `lib`: NVML (a ctypes library or a stand-in), None to load it, False to sample nothing (a CPU run)
        self._lib = _load_nvml() if lib is None else (lib or None)
        self._handle, self._stop, self._thread, self._reasons = ctypes.c_void_p(), threading.Event(), None, None
        if self._lib is None:
            return
        # NVML numbers GPUs by PCI order, CUDA (and CUDA_VISIBLE_DEVICES) may not: match by UUID when known
        # (NVML's UUIDs read "GPU-<hex groups>"; torch's device properties print the hex groups alone)
        if uuid:
            for name in dict.fromkeys((uuid, uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")):
                found = self._lib.nvmlDeviceGetHandleByUUID(name.encode(), ctypes.byref(self._handle))
                if found == 0:
                    break
        else:
            found = self._lib.nvmlDeviceGetHandleByIndex_v2(device_index, ctypes.byref(self._handle))
        if found != 0:
            self._lib = None
            return
        # the clock-event reasons (power cap, thermal, ...) under their newer name, or the older one
        self._reasons = (getattr(self._lib, "nvmlDeviceGetCurrentClocksEventReasons", None)
                         or getattr(self._lib, "nvmlDeviceGetCurrentClocksThrottleReasons", None))

    def _sample(self) -> tuple[int, int, int] | None:
        clock, milliwatts, reasons = ctypes.c_uint(), ctypes.c_uint(), ctypes.c_ulonglong()
        if (self._lib.nvmlDeviceGetClockInfo(self._handle, NVML_CLOCK_SM, ctypes.byref(clock)) != 0
                or self._lib.nvmlDeviceGetPowerUsage(self._handle, ctypes.byref(milliwatts)) != 0):
            return None
        if self._reasons is None or self._reasons(self._handle, ctypes.byref(reasons)) != 0:
            reasons.value = 0
        return clock.value, milliwatts.value, reasons.value

    def _run(self) -> None:
        while True:
            sample = self._sample()
            if sample is not None:
                self.samples.append(sample)
            if self._stop.wait(self.interval_s):
                return

    def __enter__(self) -> ClockSampler:
        if self._lib is not None:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()

    def summary(self) -> dict:
        """Means over the samples ({} when there are none)."""
        if not self.samples:
            return {}
        n = len(self.samples)
        clocks, milliwatts, reasons = zip(*self.samples)
        return {"sm_mhz": round(sum(clocks) / n), "power_w": round(sum(milliwatts) / n / 1e3),
                "power_capped": round(sum(bool(r & SW_POWER_CAP) for r in reasons) / n, 2)}
