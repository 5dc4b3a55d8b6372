"""`python -m mpfa_jit.cache`: it touches only a folder that carries the cache's marker (or an older mpfa's
cache, recognised by its manifests), deletes only the entries it recognises and says how many bytes that
freed, skips a key being built, and answers bad usage and interrupts with one line and a distinct exit code."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mpfa_jit import cache as cache_cli
from mpfa_jit import env
from mpfa_jit.store import NotACacheError, Store


def _cli(*args, root):
    return subprocess.run([sys.executable, "-m", "mpfa_jit.cache", *args], capture_output=True, text=True,
                          env={**os.environ, "MPFA_CACHE_DIR": str(root)}, timeout=120)


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _write(path: Path, data: bytes) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return len(data)


def _published(root: Path, uri: str, size: int) -> int:
    """A lib/<uri> entry as the store publishes one (its bytes)."""
    return (_write(root / "lib" / uri / "kernel.so", b"\x7fELF" + b"k" * size)
            + _write(root / "lib" / uri / "manifest.json", json.dumps({"key": uri, "uri": uri}).encode()))


@pytest.fixture
def home_local(tmp_path):
    """A folder like ~/.local: lib/ and bin/ of other software, even a lib/ entry with a manifest.json."""
    root = tmp_path / "dot-local"
    _write(root / "lib" / "python3.11" / "site-packages" / "mine.py", b"print('mine')\n")
    _write(root / "lib" / "node" / "manifest.json", b"{}")
    _write(root / "bin" / "tool", b"#!/bin/sh\n")
    _write(root / "builds.log", b"someone else's log\n")
    return root


@pytest.mark.parametrize("command", ["clear", "size", "list"])
def test_a_folder_that_is_not_a_cache_is_refused_and_untouched(home_local, command):
    before = _tree(home_local)
    r = _cli(command, root=home_local)
    assert r.returncode == 2 and r.stdout == ""
    assert len(r.stderr.splitlines()) == 1 and "is not an mpfa kernel cache" in r.stderr, r.stderr
    assert str(home_local) in r.stderr and "MPFA_CACHE_DIR" in r.stderr
    assert _tree(home_local) == before and not (home_local / env.CACHE_MARKER).exists()


def test_the_store_refuses_to_build_into_a_folder_of_other_things(home_local):
    with pytest.raises(NotACacheError, match="refusing to build into it"):
        Store(home_local).ensure()
    assert not (home_local / env.CACHE_MARKER).exists() and not (home_local / "tmp").exists()


def test_threads_creating_one_cache_at_once_all_build_into_it(tmp_path, monkeypatch):
    """A parallel warmup into a fresh folder: the marker must never be seen empty, nor the writers' temp files
    (compiler.json's, the marker's) taken for foreign files (seen on the H200: 2 of 59 builds refused)."""
    import threading
    root = tmp_path / "fresh"
    errors, start = [], threading.Barrier(16)

    def one():
        start.wait()
        try:
            Store(root).ensure()
            (root / f"compiler.{os.getpid()}.{threading.get_ident()}.tmp").write_text("{}")   # as env._compiler_id
            Store(root).ensure()
        except Exception as e:   # noqa: BLE001 - any failure is the test's finding
            errors.append(e)
    threads = [threading.Thread(target=one) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert (root / env.CACHE_MARKER).read_text() == env.CACHE_MARKER_TEXT and Store(root).state() == "cache"
    assert not list(root.glob(f"{env.CACHE_MARKER}.*.tmp"))
    # an unmarked folder holding only the cache's names and such temp files is a cache being created, not foreign
    other = tmp_path / "creating"
    _write(other / "compiler.12.34.tmp", b"{}")
    _write(other / f"{env.CACHE_MARKER}.12.34.tmp", b"")
    assert Store(other).state() == "unmarked"
    _write(other / "compiler.x.tmp", b"{}")
    assert Store(other).state() == "foreign"


@pytest.mark.parametrize("args", [[], ["nope"], ["clear", "extra"], ["--bogus", "size"]])
def test_bad_usage_is_one_line_and_exit_2(tmp_path, args):
    r = _cli(*args, root=tmp_path / "cache")
    assert r.returncode == 2 and r.stdout == ""
    assert len(r.stderr.splitlines()) == 1, r.stderr
    assert r.stderr.startswith("python -m mpfa_jit.cache: ") and r.stderr.endswith("(see --help)\n")


def test_clear_deletes_only_what_it_recognises_and_reports_the_bytes(jit_cache):
    store = Store(jit_cache)
    store.ensure()
    freed = _published(jit_cache, "append_kv_a_sm_90a_0123456789ab", 3000)
    freed += _published(jit_cache, "decode_b_sm_90a_0123456789ab", 5000)
    freed += _write(jit_cache / "tmp" / "decode_c_sm_90a_0123456789ab.4242.0" / "kernel.cu", b"c" * 700)  # a killed build
    freed += _write(jit_cache / "failed" / "decode_d_sm_90a_0123456789ab" / "build.log", b"error\n" * 10)
    freed += _write(jit_cache / "locks" / "append_kv_a_sm_90a_0123456789ab.lock", b"")
    freed += _write(jit_cache / "builds.log", b"2026-01-01T00:00:00 pid=1 built x in 1.0s\n")
    freed += _write(jit_cache / "compiler.json", b'{"nvcc": "release 13.0"}')
    kept = {"lib/notes/readme.txt": b"not a build", "tmp/scratch.txt": b"x", "mine.txt": b"y"}
    for name, data in kept.items():
        _write(jit_cache / name, data)
    assert cache_cli.main(["size"]) == 0

    r = _cli("clear", root=jit_cache)
    assert r.returncode == 0, r.stderr
    assert f"freed {freed / 1024:.1f} KiB (4 builds)" in r.stdout, r.stdout   # 2 published, 1 killed, 1 failed
    assert "left 2 unrecognised (lib/notes, tmp/scratch.txt)" in r.stdout
    # the lock file there was stays (clear never unlinks a lock); the keys that had none get none
    locks = {"locks/append_kv_a_sm_90a_0123456789ab.lock": b""}
    assert _tree(jit_cache) == {**kept, **locks, env.CACHE_MARKER: env.CACHE_MARKER_TEXT.encode()}
    assert Store(jit_cache).state() == "cache" and Store(jit_cache).entries() == []
    r = _cli("clear", root=jit_cache)
    assert r.returncode == 0 and "freed 0 B (0 builds)" in r.stdout


def test_a_cache_of_an_older_mpfa_is_recognised_by_its_manifests_and_adopted(jit_cache):
    freed = _published(jit_cache, "append_kv_a_sm_90a_0123456789ab", 100)
    freed += _write(jit_cache / "compiler.json", b"{}")
    (jit_cache / "tmp").mkdir()
    assert Store(jit_cache).state() == "legacy"
    r = _cli("list", root=jit_cache)
    assert r.returncode == 0 and "1 kernels in" in r.stdout
    r = _cli("clear", root=jit_cache)
    assert r.returncode == 0 and f"freed {freed} B (1 build)" in r.stdout, r.stdout
    assert Store(jit_cache).state() == "cache" and Store(jit_cache).entries() == []


def test_missing_cache_is_nothing_to_clear(tmp_path):
    r = _cli("clear", root=tmp_path / "never-built")
    assert r.returncode == 0 and "nothing to clear" in r.stdout and not (tmp_path / "never-built").exists()


def test_clear_during_a_build_skips_that_key_and_the_build_still_publishes(jit_cache, fake_nvcc):
    store = Store(jit_cache)
    proc = fake_nvcc.start_builder(jit_cache)
    try:
        fake_nvcc.wait_compiling(proc)
        (building,) = list((jit_cache / "tmp").iterdir())
        freed = _published(jit_cache, "append_kv_a_sm_90a_0123456789ab", 100)
        r = _cli("clear", root=jit_cache)
        assert r.returncode == 0, r.stderr
        assert f"freed {freed} B (1 build)" in r.stdout and f"skipped 1 being built now ({fake_nvcc.URI})" in r.stdout
        assert building.is_dir() and store.entries() == []
        fake_nvcc.go.touch()
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0 and "BUILT" in out, err
        assert store.check(fake_nvcc.URI) == "ok"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_an_interrupted_clear_exits_130_with_one_line(jit_cache, monkeypatch, capsys):
    Store(jit_cache).ensure()

    def interrupted(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(Store, "clear", interrupted)
    assert cache_cli.main(["clear"]) == 130
    err = capsys.readouterr().err
    assert err == "python -m mpfa_jit.cache: interrupted\n"
