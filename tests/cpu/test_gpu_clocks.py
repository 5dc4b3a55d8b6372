"""benchmarks.gpu_clocks: nvidia-smi's samples read into a clock / power summary (no GPU needed)."""
from __future__ import annotations

import os
import stat

import pytest

from benchmarks import gpu_clocks as gc

# What nvidia-smi --query-gpu=clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active
# --format=csv,noheader,nounits prints: one line a sample.
LINES = """1980, 401.52, 41, 0x0000000000000000
1755, 699.10, 47, 0x0000000000000004
1725, 700.02, 48, 0x0000000000000004
1830, 650.00, 48, 0x0000000000000044
[N/A], 120.00, 40, 0x0000000000000001
1980, 98.5"""


def test_samples_parse_and_a_line_that_does_not_is_skipped():
    s = gc.parse_samples(LINES)
    assert len(s) == 4
    assert s[1] == {"sm_clock_mhz": 1755.0, "power_w": 699.1, "temperature_c": 47.0, "reasons": 0x4}


def test_the_summary_gives_the_clock_the_power_and_why_the_clock_was_held():
    out = gc.summarize(gc.parse_samples(LINES))
    assert out["samples"] == 4
    assert out["sm_clock_mhz"] == {"median": 1792.5, "min": 1725.0, "max": 1980.0}
    assert out["power_w"] == {"mean": pytest.approx(612.7, abs=0.05), "max": 700.02}
    assert out["temperature_c_max"] == 48.0
    assert out["reasons"] == {"SW power cap": 0.75, "HW thermal slowdown": 0.25}
    assert gc.summarize([])["error"].startswith("no samples")
    assert gc.summarize([{"sm_clock_mhz": 1.0, "power_w": 1.0, "temperature_c": 1.0, "reasons": 0x1000}])[
        "reasons"] == {"other bits": 1.0}


def test_the_gpu_is_the_first_visible_one():
    assert gc.gpu_index({}) == "0"
    assert gc.gpu_index({"CUDA_VISIBLE_DEVICES": "3,1"}) == "3"
    assert gc.gpu_index({"CUDA_VISIBLE_DEVICES": ""}) == "0"


def test_the_sampler_runs_nvidia_smi_for_the_block_and_says_when_it_cannot(tmp_path, monkeypatch):
    fake = tmp_path / "nvidia-smi"   # prints two samples, then waits to be stopped as the real one does
    fake.write_text("#!/bin/sh\n"   # a driver that knows only the legacy field name, as before R535
                    "case \"$1\" in *clocks_event_reasons*) echo 'Field is not a valid field to query.'; exit 2;; esac\n"
                    "echo \"$@\" > \"$(dirname \"$0\")/argv\"\n"
                    "echo '1755, 699.10, 47, 0x0000000000000004'\n"
                    "case \"$*\" in *-lms*) ;; *) exit 0;; esac\n"
                    "echo '1725, 700.02, 48, 0x0000000000000004'\n"
                    "exec sleep 30\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    import time
    with gc.GpuSampler(gpu="2", interval_ms=50) as s:
        for _ in range(100):   # until the fake has printed its samples
            if len(gc.parse_samples(open(s._file.name).read())) == 2:
                break
            time.sleep(0.05)
    out = s.summary()
    assert out["samples"] == 2 and out["sm_clock_mhz"]["median"] == 1740.0 and out["reasons"] == {"SW power cap": 1.0}
    argv = (tmp_path / "argv").read_text().split()
    assert argv[-4:] == ["-lms", "50", "-i", "2"] and argv[0] == f"--query-gpu={gc.LEGACY_QUERY}"
    (tmp_path / "nvidia-smi").write_text("#!/bin/sh\necho 'No devices were found'\nexit 6\n")
    with gc.GpuSampler(gpu="0") as s:
        pass
    assert s.summary()["error"].startswith("nvidia-smi cannot sample GPU 0: 'No devices were found'")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with gc.GpuSampler() as s:
        pass
    assert s.summary() == {"samples": 0, "error": "nvidia-smi not found"}
