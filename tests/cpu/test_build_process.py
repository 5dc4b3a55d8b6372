"""The build's processes and leftovers, with a stand-in nvcc (tests/cpu/conftest.py): a builder killed or
interrupted mid-build leaves no ninja or nvcc running; a failed build's folder is kept where its error
says; verbose build output goes through logging."""
import logging
import os
import re
import signal
import time
from pathlib import Path

import pytest

from mpfa_jit import BuildError, Store


def _ninjas_of(root: Path) -> list[int]:
    """Running ninja processes building under ``root`` (their command line names the build folder)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z" and "ninja" in cmdline and f"-C {root}" in cmdline:
            found.append(int(entry.name))
    return found


def _wait_gone(fake, root, timeout=15.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and (fake.survivors() or _ninjas_of(root)):
        time.sleep(0.05)
    return fake.survivors(), _ninjas_of(root)


@pytest.mark.parametrize("how", ["SIGKILL", "SIGINT"])
def test_a_builder_that_dies_leaves_no_ninja_or_nvcc_running(jit_cache, fake_nvcc, how):
    proc = fake_nvcc.start_builder(jit_cache)
    try:
        fake_nvcc.wait_compiling(proc)
        assert _ninjas_of(jit_cache), "no ninja found for the build"
        # SIGKILL: the builder cannot clean up (a killed warmup). SIGINT to its pid alone, as Ctrl-C would
        # be if the build shared the terminal's process group: the builder's KeyboardInterrupt stops ninja.
        proc.send_signal(signal.SIGKILL if how == "SIGKILL" else signal.SIGINT)
        proc.communicate(timeout=30)
        nvcc_left, ninja_left = _wait_gone(fake_nvcc, jit_cache)
        assert not nvcc_left and not ninja_left, f"left running: nvcc/child {nvcc_left}, ninja {ninja_left}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert Store(jit_cache).entries() == []


def test_build_runs_in_its_own_process_group(jit_cache, fake_nvcc):
    proc = fake_nvcc.start_builder(jit_cache)
    try:
        fake_nvcc.wait_compiling(proc)
        (ninja,) = _ninjas_of(jit_cache)
        assert os.getpgid(ninja) == ninja != os.getpgid(proc.pid)
        fake_nvcc.go.touch()
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0 and "BUILT" in out, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_failed_build_is_kept_where_its_error_says(jit_cache, fake_nvcc, monkeypatch):
    monkeypatch.setenv("FAKE_NVCC_MODE", "fail")
    store = Store(jit_cache)
    with pytest.raises(BuildError) as failure:
        fake_nvcc.build(store)
    message = str(failure.value)
    assert "a compile error from the stand-in nvcc" in message
    kept = Path(re.search(r"kept in (\S+) until", message)[1])
    assert kept.is_dir() and kept.parent == jit_cache / "failed"
    assert {"kernel.cu", "build.ninja", "build.log"} <= {p.name for p in kept.iterdir()}
    assert "a compile error from the stand-in nvcc" in (kept / "build.log").read_text()
    assert not any((jit_cache / "tmp").iterdir()) and not any((jit_cache / "lib").iterdir())
    assert store.failed() == [kept]
    # A later successful build of the key replaces the failure; clear removes what is left.
    monkeypatch.setenv("FAKE_NVCC_MODE", "wait")
    fake_nvcc.go.touch()
    _, built = fake_nvcc.build(store)
    assert built and store.check(fake_nvcc.URI) == "ok" and store.failed() == [] and kept.name == fake_nvcc.URI
    assert store.clear().freed > 0 and store.entries() == []


def test_verbose_build_output_goes_through_logging(jit_cache, fake_nvcc, monkeypatch, capsys):
    monkeypatch.setenv("MPFA_JIT_VERBOSE", "1")
    fake_nvcc.go.touch()
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("mpfa_jit")
    logger.addHandler(handler)
    try:
        fake_nvcc.build(Store(jit_cache))
    finally:
        logger.removeHandler(handler)
    assert capsys.readouterr().out == ""
    text = "\n".join(r.getMessage() for r in records)
    assert "ninja" in text and str(fake_nvcc.path) in text   # ninja -v: the command it ran
