"""A stand-in nvcc for tests of the build machinery (process groups, kills, failures, clear during a build):
a shell script that MPFA_NVCC points at, so those tests run in seconds and without the CUDA toolkit."""
import os
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

# FAKE_NVCC_MODE: "fail" prints a compile error and exits 1; "wait" records its pid and a child's in
# FAKE_NVCC_PIDS, then waits (a slow build) until FAKE_NVCC_GO exists and writes the output file.
FAKE_NVCC = textwrap.dedent("""\
    #!/bin/sh
    if [ "$1" = "--version" ]; then
        echo "Cuda compilation tools, release 13.0, V13.0.0 (a stand-in nvcc for tests)"
        exit 0
    fi
    for out; do :; done   # the last argument: -o <out>
    if [ "$FAKE_NVCC_MODE" = "fail" ]; then
        echo "kernel.cu(1): error: a compile error from the stand-in nvcc" >&2
        exit 1
    fi
    sleep 300 &
    echo "$$ $!" >> "$FAKE_NVCC_PIDS"
    while [ ! -e "$FAKE_NVCC_GO" ]; do sleep 0.05; done
    kill $! 2>/dev/null
    printf 'a stand-in library' > "$out"
""")


# Builds go straight to the store with a one-line source: what is tested is the process around nvcc, and
# a builder process starts in a fraction of a second (no op module, no torch).
_SPEC = ("stand_in", "stand_in.cu.jinja", {"n": 1}, "sm_90a")
_SOURCE = "// built by the stand-in nvcc\n"
_BUILDER = textwrap.dedent(f"""\
    from mpfa_jit.spec import KernelSpec
    from mpfa_jit.store import Store
    Store().get_or_build(KernelSpec.make(*{_SPEC!r}), {_SOURCE!r}, "stand_in_n-1_sm_90a")
    print("BUILT", flush=True)
""")


@dataclass
class FakeNvcc:
    path: Path
    pids: Path   # "<nvcc pid> <its child's pid>" per started compile
    go: Path     # create it to let waiting compiles finish
    URI = "stand_in_n-1_sm_90a"

    @staticmethod
    def default_sigint() -> None:
        """Popen's preexec_fn for a child a test interrupts: SIGINT at its default, so that Python installs its
        KeyboardInterrupt handler (a test runner started in the background by a non-interactive shell inherits
        SIGINT ignored, and a Python started with SIGINT ignored keeps ignoring it)."""
        signal.signal(signal.SIGINT, signal.SIG_DFL)

    def build(self, store):
        """Build the stand-in key in this process; returns get_or_build's (path, built_here)."""
        from mpfa_jit.spec import KernelSpec
        return store.get_or_build(KernelSpec.make(*_SPEC), _SOURCE, self.URI)

    def start_builder(self, root: Path, mode: str = "wait") -> subprocess.Popen:
        """A process that builds the stand-in key into the cache at ``root``."""
        return subprocess.Popen([sys.executable, "-c", _BUILDER], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env={**os.environ, "MPFA_CACHE_DIR": str(root), **self.env(mode)},
                                preexec_fn=self.default_sigint)

    def wait_compiling(self, proc: subprocess.Popen, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not self.started():
            if proc.poll() is not None:
                pytest.fail(f"the builder exited early: {proc.communicate()[1]}")
            time.sleep(0.02)
        assert self.started(), "the stand-in nvcc never started"

    def env(self, mode: str) -> dict:
        return {"MPFA_NVCC": str(self.path), "FAKE_NVCC_MODE": mode, "FAKE_NVCC_PIDS": str(self.pids),
                "FAKE_NVCC_GO": str(self.go)}

    def started(self) -> list[int]:
        return [int(p) for line in self.pids.read_text().splitlines() for p in line.split()] \
            if self.pids.exists() else []

    def survivors(self) -> list[int]:
        """The started processes still running (zombies excluded), checked to be still this script's or
        its sleep: a pid reused by an unrelated process is not counted (and never killed)."""
        alive = []
        for pid in self.started():
            try:
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except (OSError, IndexError):
                continue
            if state != "Z" and (str(self.path) in cmdline or cmdline.startswith("sleep 300")):
                alive.append(pid)
        return alive


@pytest.fixture
def fake_nvcc(tmp_path, monkeypatch):
    if not sys.platform.startswith("linux"):
        pytest.skip("the build-process tests read /proc (Linux)")
    folder = tmp_path / "fake-cuda" / "bin"
    folder.mkdir(parents=True)
    path = folder / "nvcc"
    path.write_text(FAKE_NVCC)
    path.chmod(0o755)
    fake = FakeNvcc(path, tmp_path / "nvcc.pids", tmp_path / "nvcc.go")
    for key, value in fake.env("wait").items():
        monkeypatch.setenv(key, value)
    yield fake
    fake.go.touch()   # let anything still waiting finish
    for pid in fake.survivors():
        try:
            os.kill(pid, 9)
        except (ProcessLookupError, PermissionError):
            pass
