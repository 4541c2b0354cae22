"""bench/gpu_clocks.py: the NVML sampler's summary, with a stand-in for the NVML library (no GPU here)."""
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from gpu_clocks import ClockSampler  # noqa: E402


class StandInNvml:
    """Answers like libnvidia-ml: 0 = success, results written through the ctypes byref arguments."""

    def __init__(self, clock_mhz, milliwatts, reasons, uuid=b"GPU-abc"):
        self.reading, self.uuid = (clock_mhz, milliwatts, reasons), uuid

    def nvmlDeviceGetHandleByUUID(self, uuid, handle):
        return 0 if uuid == self.uuid else 13  # NVML_ERROR_NOT_FOUND

    def nvmlDeviceGetHandleByIndex_v2(self, index, handle):
        return 0 if index == 0 else 2

    def nvmlDeviceGetClockInfo(self, handle, clock_type, out):
        out._obj.value = self.reading[0] if clock_type == 1 else 0
        return 0

    def nvmlDeviceGetPowerUsage(self, handle, out):
        out._obj.value = self.reading[1]
        return 0

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle, out):
        out._obj.value = self.reading[2]
        return 0


def test_sampler_means_clock_power_and_power_cap_share():
    with ClockSampler(lib=StandInNvml(1500, 690_000, 0x4), uuid="abc", interval_s=0.001) as clocks:  # as torch prints it
        time.sleep(0.05)
    assert len(clocks.samples) >= 2
    assert clocks.summary() == {"sm_mhz": 1500, "power_w": 690, "power_capped": 1.0}
    clocks.samples = [(1400, 700_000, 0x4), (1800, 680_000, 0x0)]
    assert clocks.summary() == {"sm_mhz": 1600, "power_w": 690, "power_capped": 0.5}


def test_sampler_without_nvml_or_device_records_nothing():
    for sampler in (ClockSampler(lib=False), ClockSampler(lib=StandInNvml(1, 1, 0), uuid="GPU-other"),
                    ClockSampler(3, lib=StandInNvml(1, 1, 0))):
        with sampler as clocks:
            time.sleep(0.01)
        assert clocks.samples == [] and clocks.summary() == {}
