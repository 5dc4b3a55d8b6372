"""The GPU's SM clock, power, temperature and clock-event reasons, sampled by nvidia-smi while a block runs.

    with GpuSampler() as s:
        ...                       # the work (in this process or a server's)
    s.summary()                   # {"samples", "sm_clock_mhz": {median, min, max}, "power_w": {mean, max}, ...}

Why: the same compute-bound kernel (a GEMM) can take several percent longer in one server than in another when
the GPU lowers its clock for power or heat; kernel time alone cannot tell that from a slower kernel. The summary
says which clock the work ran at and why the GPU held it back (NVML's clock-event reasons, the fraction of samples
each was active). No CUDA context; nvidia-smi missing or failing gives ``{"error": ...}`` instead of a summary.
"""
from __future__ import annotations

import os
import shutil
import signal
import statistics
import subprocess
import tempfile
from pathlib import Path

QUERY = "clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active"
# Drivers before R535 name the reasons field clocks_throttle_reasons.active.
LEGACY_QUERY = QUERY.replace("clocks_event_reasons", "clocks_throttle_reasons")
INTERVAL_MS = 20
# NVML nvmlClocksEventReason* bits (nvml.h); "idle" and "applications clocks" are the GPU's normal states.
REASONS = {0x1: "gpu idle", 0x2: "applications clocks setting", 0x4: "SW power cap", 0x8: "HW slowdown",
           0x10: "sync boost", 0x20: "SW thermal slowdown", 0x40: "HW thermal slowdown",
           0x80: "HW power brake slowdown", 0x100: "display clock setting"}


def gpu_index(env=None) -> str:
    """The physical GPU this process's device 0 is: the first entry of CUDA_VISIBLE_DEVICES, else 0."""
    env = os.environ if env is None else env
    first = env.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    return first or "0"


def parse_samples(text: str) -> list[dict]:
    """nvidia-smi's ``--format=csv,noheader,nounits`` lines of QUERY -> one dict per sample; a line that does not
    parse (a field nvidia-smi reports as [N/A], a cut last line) is skipped."""
    samples = []
    for line in text.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != 4:
            continue
        try:
            samples.append({"sm_clock_mhz": float(fields[0]), "power_w": float(fields[1]),
                            "temperature_c": float(fields[2]), "reasons": int(fields[3], 16)})
        except ValueError:
            continue
    return samples


def summarize(samples: list[dict]) -> dict:
    """Clock median / min / max, power mean / max, the hottest temperature and, per active reason, the fraction of
    samples it was active in."""
    if not samples:
        return {"samples": 0, "error": "no samples (nvidia-smi gave none that parse)"}
    clocks = [s["sm_clock_mhz"] for s in samples]
    power = [s["power_w"] for s in samples]
    reasons = {}
    for bit, name in REASONS.items():
        n = sum(1 for s in samples if s["reasons"] & bit)
        if n:
            reasons[name] = round(n / len(samples), 3)
    unknown = sum(1 for s in samples if s["reasons"] & ~sum(REASONS))
    if unknown:
        reasons["other bits"] = round(unknown / len(samples), 3)
    return {"samples": len(samples),
            "sm_clock_mhz": {"median": statistics.median(clocks), "min": min(clocks), "max": max(clocks)},
            "power_w": {"mean": round(statistics.fmean(power), 1), "max": max(power)},
            "temperature_c_max": max(s["temperature_c"] for s in samples),
            "reasons": reasons}


class GpuSampler:
    """nvidia-smi sampling QUERY every ``interval_ms`` on GPU ``gpu`` (default :func:`gpu_index`) for the
    duration of the ``with`` block."""

    def __init__(self, gpu: str | None = None, interval_ms: int = INTERVAL_MS):
        self.gpu = gpu_index() if gpu is None else str(gpu)
        self.interval_ms = interval_ms
        self._proc = None
        self._file = None
        self._error = None
        self._text = ""

    def __enter__(self) -> "GpuSampler":
        exe = shutil.which("nvidia-smi")
        if exe is None:
            self._error = "nvidia-smi not found"
            return self
        query = self._query(exe)
        if query is None:
            return self
        self._file = tempfile.NamedTemporaryFile("w+", suffix=".csv", delete=False)
        self._proc = subprocess.Popen([exe, f"--query-gpu={query}", "--format=csv,noheader,nounits",
                                       "-lms", str(self.interval_ms), "-i", self.gpu],
                                      stdout=self._file, stderr=subprocess.STDOUT, text=True)
        return self

    def _query(self, exe: str) -> str | None:
        """QUERY, or LEGACY_QUERY where this driver's nvidia-smi only knows that one: one sample of each, first
        that parses wins (records the error and returns None when neither does)."""
        said = ""
        for query in (QUERY, LEGACY_QUERY):
            try:
                out = subprocess.run([exe, f"--query-gpu={query}", "--format=csv,noheader,nounits", "-i", self.gpu],
                                     capture_output=True, text=True, timeout=30)
            except (OSError, subprocess.TimeoutExpired) as e:
                said = str(e)
                continue
            if parse_samples(out.stdout):
                return query
            said = (out.stdout + out.stderr).strip()
        self._error = f"nvidia-smi cannot sample GPU {self.gpu}: {said[:300]!r}"
        return None

    def __exit__(self, *exc) -> None:
        if self._proc is None:
            return
        self._proc.send_signal(signal.SIGINT)   # nvidia-smi's loop ends on it as on Ctrl-C, its output flushed
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._file.close()
        path = Path(self._file.name)
        self._text = path.read_text(errors="replace")
        path.unlink(missing_ok=True)
        if not parse_samples(self._text):
            self._error = f"nvidia-smi gave no samples: {self._text.strip()[:300]!r}"

    def summary(self) -> dict:
        if self._error is not None:
            return {"samples": 0, "error": self._error}
        return summarize(parse_samples(self._text))
