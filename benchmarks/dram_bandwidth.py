"""Prints what the norms' tail_by_device rule reads (cuda_src/layer_norm.cuh): the
current GPU's memory clock and bus width (cudaDeviceGetAttribute 36 / 37 through
libcudart) and the peak DRAM bandwidth they give, 2 x clock x width, against the cut.

    python3 benchmarks/dram_bandwidth.py
"""
import ctypes
import glob
import os
import re
import sys
import sysconfig

MEMORY_CLOCK_KHZ, BUS_WIDTH_BITS = 36, 37  # cudaDevAttrMemoryClockRate, cudaDevAttrGlobalMemoryBusWidth
HEADER = os.path.join(os.path.dirname(__file__), "..", "cuda_src", "layer_norm.cuh")


def libcudart():
    """The first libcudart found: pip's nvidia packages, then the toolkit's."""
    site = sysconfig.get_paths()["purelib"]
    for pattern in (f"{site}/nvidia/**/libcudart.so*", "/usr/local/cuda*/lib64/libcudart.so*"):
        for path in sorted(glob.glob(pattern, recursive=True), reverse=True):
            try:
                return ctypes.CDLL(path), path
            except OSError:
                continue
    raise SystemExit("dram_bandwidth: no libcudart found")


def main() -> None:
    lib, path = libcudart()
    values = {}
    for attr in (MEMORY_CLOCK_KHZ, BUS_WIDTH_BITS):
        v = ctypes.c_int(0)
        err = lib.cudaDeviceGetAttribute(ctypes.byref(v), attr, 0)
        if err != 0:
            raise SystemExit(f"dram_bandwidth: cudaDeviceGetAttribute({attr}) failed with error {err} ({path})")
        values[attr] = v.value
    gbps = 2 * values[MEMORY_CLOCK_KHZ] * 1e3 * values[BUS_WIDTH_BITS] / 8 / 1e9
    cut = float(re.search(r"kTailFastDramGbps = ([\d.]+)", open(HEADER).read()).group(1))
    print(f"memory clock {values[MEMORY_CLOCK_KHZ]} kHz, bus {values[BUS_WIDTH_BITS]} bits: peak DRAM "
          f"{gbps:.0f} GB/s; tail_by_device (cut {cut:.0f}): {gbps >= cut}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
