"""The kernel cache never reaches outside its folder: ``clear`` unlinks a symbolic link where the cache keeps
its folders (failed/, lib/, tmp/, locks/) or entries and leaves what it points to; a build refuses to run
through such a link and never loads a kernel through one. Also: a folder in lib/ that is not a kernel is listed
as unrecognised, a cache folder that cannot be written is one clear error, and the evaluation text lives
outside the kernel cache."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mpfa_jit import env
from mpfa_jit.errors import CacheDirError, MpfaJitError
from mpfa_jit.store import Store

REPO = Path(__file__).resolve().parents[2]
URI = "decode_b_sm_90a_0123456789ab"


def _cli(*args, root, **extra_env):
    return subprocess.run([sys.executable, "-m", "mpfa_jit.cache", *args], capture_output=True, text=True,
                          env={**os.environ, "MPFA_CACHE_DIR": str(root), **extra_env}, timeout=120)


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def _published(folder: Path, uri: str) -> None:
    _write(folder / "kernel.so", b"\x7fELF" + b"k" * 100)
    _write(folder / "manifest.json", json.dumps({"key": uri, "uri": uri}).encode())


@pytest.fixture
def outside(tmp_path):
    """A folder of someone's files beside the cache: what a link in the cache may point to."""
    root = tmp_path / "home-of-user"
    root.mkdir()
    return root


@pytest.fixture
def cache(jit_cache):
    Store(jit_cache).ensure()
    _published(jit_cache / "lib" / URI, URI)   # a published entry beside the link, so clear has work to do
    return jit_cache


# Each route of issue 30: the cache's folder swapped for a link to a folder whose entries look like builds.
ROUTES = {
    "failed": {"photos/p.jpg": b"jpeg", "thesis/ch1.tex": b"tex"},
    "lib": {"node/manifest.json": b"{}", "node/index.js": b"js"},
    "tmp": {"photos.2024.06/p.jpg": b"jpeg", "x.1.2/notes.txt": b"notes"},
    # clear takes a key's lock there: it would create lock files outside (and an older filelock, which opens
    # with O_TRUNC, would empty a file of the key's name)
    "locks": {"mine.lock": b"precious"},
}


@pytest.mark.parametrize("folder", sorted(ROUTES))
def test_clear_unlinks_a_linked_cache_folder_and_leaves_what_it_points_to(cache, outside, folder):
    for name, data in ROUTES[folder].items():
        _write(outside / name, data)
    before = _tree(outside)
    real = cache / folder
    for p in sorted(real.rglob("*"), reverse=True):
        p.rmdir() if p.is_dir() else p.unlink()
    real.rmdir()
    real.symlink_to(outside, target_is_directory=True)

    r = _cli("clear", root=cache)
    assert _tree(outside) == before
    assert r.returncode == 0, r.stderr
    assert f"unlinked 1 symbolic link, not followed ({folder})" in r.stdout, r.stdout
    assert real.is_dir() and not real.is_symlink() and not any(real.iterdir())
    assert Store(cache).entries() == [] and Store(cache).state() == "cache"


def test_clear_unlinks_linked_entries_without_following_them(cache, outside):
    _published(outside / "a-kernel", "other")
    _write(outside / "build" / "kernel.cu", b"src")
    _write(outside / "failure" / "build.log", b"log")
    _write(outside / "file.lock", b"precious")
    before = _tree(outside)
    links = {f"lib/{URI}x": outside / "a-kernel", f"tmp/{URI}.99.0": outside / "build",
             f"failed/{URI}": outside / "failure", f"locks/{URI}.lock": outside / "file.lock"}
    for name, target in links.items():
        (cache / name).symlink_to(target)

    r = _cli("clear", root=cache)
    assert _tree(outside) == before
    assert r.returncode == 0, r.stderr
    assert "(1 build)" in r.stdout and "unlinked 4 symbolic links, not followed" in r.stdout, r.stdout
    assert not any(os.path.lexists(cache / name) for name in links)
    assert not (cache / "lib" / URI).exists()


def test_list_shows_links_and_never_follows_them(cache, outside):
    _published(outside / "node", "node")
    (cache / "lib" / "node").symlink_to(outside / "node")
    r = _cli("list", root=cache)
    assert r.returncode == 0, r.stderr
    assert "1 kernels in" in r.stdout and "node" not in r.stdout.split("kernels in")[0], r.stdout
    assert "1 symbolic link, not followed; clear removes a link, never its target (lib/node)" in r.stdout


def test_a_build_refuses_a_linked_lib_and_writes_nothing_through_it(jit_cache, outside, fake_nvcc):
    Store(jit_cache).ensure()
    (jit_cache / "lib").rmdir()
    (jit_cache / "lib").symlink_to(outside, target_is_directory=True)
    fake_nvcc.go.touch()
    with pytest.raises(CacheDirError, match=r"lib is a symbolic link \(to .*home-of-user\).*never follows"):
        fake_nvcc.build(Store(jit_cache))
    assert list(outside.iterdir()) == []


def test_a_linked_entry_is_never_loaded_and_a_build_replaces_the_link(jit_cache, outside, fake_nvcc):
    store = Store(jit_cache)
    fake_nvcc.go.touch()
    path, built = fake_nvcc.build(store)
    assert built
    real = store.entry_dir(fake_nvcc.URI)
    real.rename(outside / "moved")          # a valid build, but outside the cache, reached by a link
    real.symlink_to(outside / "moved")
    before = _tree(outside)
    assert store.check(fake_nvcc.URI) == "corrupt"
    path, built = fake_nvcc.build(store)
    assert built and path == real / path.name and not real.is_symlink() and store.check(fake_nvcc.URI) == "ok"
    assert _tree(outside) == before


def test_a_linked_root_is_the_cache_it_points_to(tmp_path, outside):
    """MPFA_CACHE_DIR may be a link the user made (to a scratch disk): resolved once, it is the cache."""
    real = tmp_path / "scratch" / "mpfa"
    Store(real).ensure()
    _published(real / "lib" / URI, URI)
    link = tmp_path / "cache-link"
    link.symlink_to(real, target_is_directory=True)
    assert Store(link).root == real
    r = _cli("clear", root=link)
    assert r.returncode == 0 and "(1 build)" in r.stdout, r.stdout + r.stderr
    assert Store(real).entries() == [] and (real / env.CACHE_MARKER).is_file() and link.is_symlink()


def test_a_folder_in_lib_that_is_no_kernel_is_listed_as_unrecognised_not_corrupt(cache):
    _write(cache / "lib" / "notes" / "readme.txt", b"not a build")
    _write(cache / "lib" / "decode_c_sm_90a_0123456789ab" / "manifest.json", b"{not json")   # a damaged kernel
    r = _cli("list", root=cache)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert "2 kernels in" in r.stdout and not any("notes" in line and "[" in line for line in lines), r.stdout
    # the damaged kernel and the fixture's (its manifest has no hash) are corrupt; the folder of notes is no kernel
    assert sum("[corrupt]" in line for line in lines) == 2
    assert "1 unrecognised, not kernels, left alone by clear (lib/notes)" in r.stdout


def _without_write_override() -> list[str]:
    """The command prefix that denies this test's builder writes into a folder of mode 555: none needed for a
    user; root may write anywhere through CAP_DAC_OVERRIDE, so as root the builder runs without it."""
    if os.geteuid() != 0:
        return []
    if not shutil.which("setpriv"):
        pytest.skip("running as root without util-linux's setpriv: no way to deny the builder a write")
    drop = "-dac_override,-dac_read_search"
    return ["setpriv", f"--inh-caps={drop}", f"--bounding-set={drop}", "--"]


def test_an_unwritable_cache_folder_is_one_clear_error(tmp_path):
    folder = tmp_path / "read-only"
    folder.mkdir(mode=0o555)
    probe = ("import sys\nfrom mpfa_jit.errors import MpfaJitError\nfrom mpfa_jit.store import Store\n"
             "try:\n    Store().ensure()\nexcept MpfaJitError as e:\n"
             "    print(type(e).__name__, e)\n    sys.exit(3)\n")
    r = subprocess.run([*_without_write_override(), sys.executable, "-c", probe], capture_output=True, text=True,
                       timeout=120, cwd=REPO, env={**os.environ, "MPFA_CACHE_DIR": str(folder)})
    assert r.returncode == 3 and r.stderr == "", r.stdout + r.stderr
    assert r.stdout.startswith(f"CacheDirError cannot use {folder} as the kernel cache: writing its marker "
                               f"{env.CACHE_MARKER} failed: Permission denied; point MPFA_CACHE_DIR at"), r.stdout
    assert len(r.stdout.splitlines()) == 1 and list(folder.iterdir()) == []
    assert issubclass(CacheDirError, MpfaJitError)


def test_the_evaluation_text_is_kept_outside_the_kernel_cache(tmp_path):
    """On a fresh HOME, text placed where benchmarks.accuracy.data keeps it leaves the default kernel cache
    usable: list works and a build may create the cache (nothing is downloaded)."""
    home = tmp_path / "home"
    home.mkdir()
    fresh = {k: v for k, v in os.environ.items() if k not in ("MPFA_CACHE_DIR", "MPFA_EVAL_DATA_DIR")}
    fresh["HOME"] = str(home)
    place = ("from benchmarks.accuracy import data\n"
             "d = data.DEFAULT_DATA_DIR\nd.mkdir(parents=True)\n(d / 'kjv.txt').write_text('verse\\n' * 200_000)\n"
             "print(data.fetch_kjv())\n")   # already there: fetch_kjv returns it, no download
    r = subprocess.run([sys.executable, "-c", place], capture_output=True, text=True, timeout=120, cwd=REPO,
                       env=fresh)
    assert r.returncode == 0, r.stderr
    kept = Path(r.stdout.strip())
    cache = home / ".cache" / "mpfa"
    assert kept.is_file() and not kept.is_relative_to(cache)
    r = subprocess.run([sys.executable, "-m", "mpfa_jit.cache", "list"], capture_output=True, text=True,
                       timeout=120, env=fresh)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    fresh_store = Store(cache)
    fresh_store.ensure()
    assert fresh_store.state() == "cache"


def test_the_evaluation_data_folder_is_set_apart_and_never_inside_the_kernel_cache(tmp_path, monkeypatch):
    from benchmarks.accuracy import data
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("MPFA_EVAL_DATA_DIR", raising=False)
    assert data.default_data_dir() == tmp_path / "home" / ".cache" / "mpfa-eval-data"
    monkeypatch.setenv("MPFA_EVAL_DATA_DIR", str(tmp_path / "texts"))
    assert data.default_data_dir() == tmp_path / "texts"
    cache = tmp_path / "kernels"
    monkeypatch.setenv("MPFA_CACHE_DIR", str(cache))
    for inside in (cache, cache / "eval-data"):
        with pytest.raises(data.DataDirError, match=r"lies inside mpfa's kernel cache .*MPFA_EVAL_DATA_DIR"):
            data.fetch_kjv(inside)
    assert not cache.exists()
    assert data.main(["--data-dir", str(cache / "eval-data")]) == 2


def test_a_cache_holding_old_evaluation_text_says_where_it_belongs(jit_cache):
    _write(jit_cache / "eval-data" / "kjv.txt", b"verse\n")
    r = _cli("list", root=jit_cache)
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1
    assert "eval-data is evaluation text" in r.stderr and "mpfa-eval-data" in r.stderr, r.stderr
