"""GPU timelines from a profiler trace, shared by the timeline benchmarks
(step_timeline.py, sharding_timeline.py)."""
from __future__ import annotations

import glob
import os
import tempfile

import jax


def gpu_events(call) -> dict[str, list]:
    """{device plane name: sorted (start ns, end ns, kernel name, hlo_op)} of every GPU
    kernel that call() launches (memcpys left out), traced after one untraced call."""
    jax.block_until_ready(call())
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        try:
            jax.block_until_ready(call())
        finally:
            jax.profiler.stop_trace()
        path = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)[0]
        data = jax.profiler.ProfileData.from_file(path)
    out: dict[str, list] = {}
    for plane in data.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        evs = out.setdefault(plane.name, [])
        for line in plane.lines:
            if "memcpy" in line.name.lower():
                continue
            evs.extend((ev.start_ns, ev.end_ns, ev.name, str(dict(ev.stats).get("hlo_op", "")))
                       for ev in line.events)
        evs.sort()
    return out


def busy_and_gaps(events) -> tuple[float, list]:
    """(ns when at least one of the sorted events runs, [(idle ns, event before, event
    after)] largest first) between the first start and the last end."""
    busy, gaps, last_end = 0.0, [], events[0][0] if events else 0
    for i, ev in enumerate(events):
        s, e = ev[0], ev[1]
        if s > last_end:
            gaps.append((s - last_end, events[i - 1] if i else None, ev))
        busy += max(0.0, e - max(s, last_end))  # overlapping kernels counted once
        last_end = max(last_end, e)
    gaps.sort(key=lambda g: -g[0])
    return busy, gaps
