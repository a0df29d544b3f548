"""CPU: benchmarks/memory_peak.py's reading of a memory history (synthetic traces, no GPU)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import memory_peak  # noqa: E402


def event(action, addr, size, filename="/x/l2lightning/tune/throwaway.py", line=42, name="forward"):
    return {
        "action": action,
        "addr": addr,
        "size": size,
        "frames": [{"filename": filename, "line": line, "name": name}],
    }


def test_the_peak_is_the_most_bytes_alive_and_lists_what_was_alive_then():
    trace = [
        event("alloc", 1, 100),
        event("alloc", 2, 50),
        event("free_requested", 1, 100),  # not yet free: the allocator frees at free_completed
        event("alloc", 3, 30),  # peak: 180 with 1, 2 and 3 alive
        event("free_completed", 1, 100),
        event("alloc", 4, 60),  # 140: below the peak
    ]
    peak, alive = memory_peak.live_at_peak(trace)
    assert peak == 180
    assert sorted(alive) == [1, 2, 3]


def test_the_reserved_peak_is_the_most_segment_bytes_mapped_with_their_stream_and_maker():
    mib = 1 << 20
    trace = [
        {**event("segment_alloc", 10, 20 * mib), "stream": 0},
        {
            **event("segment_alloc", 11, 2 * mib, filename="/r/l2lightning/callback/step_capture.py", line=7),
            "stream": 5,
        },
        event("alloc", 10, 20 * mib),  # block events do not count towards the reserved bytes
        {**event("segment_free", 10, 20 * mib), "stream": 0},
        {**event("segment_alloc", 12, 4 * mib), "stream": 0},  # 6 MiB mapped: below the 22 of the peak
    ]
    peak, segments = memory_peak.reserved_at_peak(trace)
    assert peak == 22 * mib
    assert sorted(segments) == [10, 11]
    rows = memory_peak.segment_groups(segments)
    assert rows[0] == {"where": "stream 0: l2lightning/tune/throwaway.py:42 forward", "mib": 20.0, "count": 1}
    assert rows[1]["where"] == "stream 5: l2lightning/callback/step_capture.py:7 forward"


def test_capture_segments_are_those_mapped_under_the_capture_grouped_by_their_innermost_frame():
    mib = 1 << 20
    capture = [{"filename": "/s/site-packages/torch/cuda/graphs.py", "line": 3, "name": "capture_begin"}]
    capture.append(
        {"filename": "/r/l2lightning/callback/step_capture.py", "line": 9, "name": "_capture_into"}
    )
    trace = [
        {**event("segment_alloc", 1, 20 * mib), "stream": 7},  # before any capture: not listed
        {"action": "segment_alloc", "addr": 2, "size": 2 * mib, "stream": 7, "frames": capture},
        {"action": "segment_alloc", "addr": 3, "size": 4 * mib, "stream": 7, "frames": capture},
    ]
    rows = memory_peak.capture_segments(trace)
    assert rows == [
        {
            "where": "stream 7: torch/cuda/graphs.py:3 capture_begin (via l2lightning/callback/step_capture.py:9 _capture_into)",
            "mib": 6.0,
            "count": 2,
        }
    ]


def test_allocations_group_by_the_innermost_frame_of_the_package_before_lightning_and_torch():
    frames = [
        {"filename": "/site/torch/nn/modules/linear.py", "line": 125, "name": "forward"},
        {"filename": "/site/lightning/pytorch/core/module.py", "line": 9, "name": "log"},
        {"filename": "/repo/l2lightning/graph/optim.py", "line": 158, "name": "run"},
    ]
    assert memory_peak.frame_label(frames) == "l2lightning/graph/optim.py:158 run"
    assert memory_peak.frame_label(frames[:2]) == "lightning/pytorch/core/module.py:9 log"
    assert memory_peak.frame_label([]).startswith("(no Python frame")
    mib = 1 << 20
    alive = {
        1: event("alloc", 1, 3 * mib),
        2: event("alloc", 2, 1 * mib),
        3: event("alloc", 3, 8 * mib, filename="/repo/l2lightning/graph/optim.py", line=158, name="run"),
    }
    rows = memory_peak.groups(alive)
    assert rows[0] == {"where": "l2lightning/graph/optim.py:158 run", "mib": 8.0, "count": 1}
    assert rows[1] == {"where": "l2lightning/tune/throwaway.py:42 forward", "mib": 4.0, "count": 2}


def test_unknown_scenarios_are_refused_by_name(capsys):
    with pytest.raises(SystemExit):
        memory_peak.main(["--out", "/tmp/unused", "--scenarios", "fit-off,nope"])
    err = capsys.readouterr().err
    assert "unknown ['nope']" in err and "fit-off" in err


def test_each_steps_peak_counts_what_earlier_steps_left_alive_and_lists_the_steps_own_allocations():
    mib = 1 << 20
    trace = [
        event("alloc", 1, 10 * mib),  # before the first step: alive throughout
        # step 0 starts at index 1
        event("alloc", 2, 4 * mib),
        event("alloc", 3, 2 * mib),  # step 0's peak: 16 MiB
        event("free_completed", 3, 2 * mib),
        # step 1 starts at index 4, with 14 MiB alive (block 2 outlived step 0)
        {**event("alloc", 4, 8 * mib, name="workspace"), "stream": 7},  # step 1's peak: 22 MiB
        event("free_completed", 4, 8 * mib),
        event("alloc", 5, 1 * mib),
    ]
    steps = memory_peak.step_peaks(trace, [1, 4])
    assert [(s["start_mib"], s["peak_mib"]) for s in steps] == [(10.0, 16.0), (14.0, 22.0)]
    # at step 1's peak: block 1 (before the fit), 2 (step 0's) and 4 (its own, the only one listed)
    assert sum(g["count"] for g in steps[1]["alive_at_peak"]) == 3
    assert steps[1]["own_at_peak"] == [{"mib": 8.0, "stream": 7, "frames": ["throwaway.py:42 workspace"]}]
    assert [o["mib"] for o in steps[0]["own_at_peak"]] == [4.0, 2.0]
