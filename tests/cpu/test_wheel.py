"""mpfa as users install it, a wheel and not this checkout: the wheel ships every file a kernel build
reads, and a fresh virtualenv with only the wheel installed compiles a server's kernels from another
folder. Also the guard that keeps CI honest: where nvcc exists, the compile tests cannot skip."""
import os
import re
import shutil
import site
import subprocess
import sys
import sysconfig
import textwrap
import tomllib
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TEMPLATES = REPO / "templates"
# The reproduction: Llama-3.1-8B's attention shape on one GPU, the qk4pv8 recipe.
SERVER = ["--num-qo-heads", "32", "--num-kv-heads", "8", "--head-dim", "128", "--recipe", "qk4pv8",
          "--page-size", "16"]
# Settings the warmup reads from the environment; the test states its own.
_AMBIENT = ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "MPFA_CONFIG", "MPFA_RECIPE", "MPFA_PAGE_SIZE",
            "MPFA_COMPENSATION", "MPFA_KERNEL_BACKEND", "MPFA_CACHE_DIR")


def _source_files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and "__pycache__" not in p.parts}


def _copy_sources(dest: Path) -> Path:
    """The files `pip wheel .` reads, copied out of the checkout: a build in place would write build/ into
    the repository, and its build/lib keeps files deleted since, which the next wheel would ship."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    for p in REPO.iterdir():
        if p.is_file():
            shutil.copy2(p, dest / p.name)
    for folder in project["tool"]["setuptools"]["package-dir"].values():
        shutil.copytree(REPO / folder, dest / folder, ignore=shutil.ignore_patterns("__pycache__"),
                        dirs_exist_ok=True)
    return dest


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    src = _copy_sources(tmp_path_factory.mktemp("src"))
    out = tmp_path_factory.mktemp("wheel")
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                        str(out), str(src)], capture_output=True, text=True)
    assert r.returncode == 0, f"pip wheel failed:\n{r.stdout}\n{r.stderr}"
    return next(out.glob("mpfa-*.whl"))


def test_wheel_ships_every_template_and_module(wheel):
    """templates/ is what nvcc reads (the .jinja sources and every header they include, in every
    sub-folder): the wheel holds that tree file for file, and every module of both packages."""
    with zipfile.ZipFile(wheel) as z:
        shipped = {n: z.read(n) for n in z.namelist() if not n.endswith("/")}
    prefix = "mpfa_jit/templates/"
    in_wheel = {n[len(prefix):]: data for n, data in shipped.items() if n.startswith(prefix)}
    in_repo = _source_files(TEMPLATES)
    missing = sorted(set(in_repo) - set(in_wheel))
    assert not missing, f"templates/ files missing from the wheel: {missing}"
    extra = sorted(set(in_wheel) - set(in_repo))
    assert not extra, f"wheel templates that templates/ does not have: {extra}"
    assert [n for n in in_repo if in_wheel[n] != in_repo[n]] == []
    assert any(n.startswith("include/mpfa/append/") for n in in_wheel)   # the sub-folders, not only the top
    for package, folder in (("mpfa", REPO / "python" / "mpfa"), ("mpfa_jit", REPO / "mpfa_jit")):
        missing = [f"{package}/{n}" for n in _source_files(folder) if f"{package}/{n}" not in shipped]
        assert missing == [], f"files of {package} missing from the wheel"


def _fresh_venv(root: Path, wheel: Path) -> Path:
    """A new virtualenv with the wheel installed (not editable). Third-party packages (torch is several GB
    and cannot be downloaded here) come from this environment's site-packages through a .pth line: a folder
    a .pth names is not scanned for .pth files, so the editable mpfa's finder there is never installed."""
    subprocess.run([sys.executable, "-m", "venv", str(root)], check=True, capture_output=True)
    python = root / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    ours = [p for p in dict.fromkeys(site.getsitepackages() + [sysconfig.get_paths()["purelib"]])
            if os.path.isdir(p)]
    Path(purelib, "_mpfa_test_host_packages.pth").write_text("".join(f"{p}\n" for p in ours))
    r = subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
                       capture_output=True, text=True)
    assert r.returncode == 0, f"installing the wheel failed:\n{r.stdout}\n{r.stderr}"
    return root


@pytest.mark.nvcc
def test_installed_wheel_builds_a_servers_kernels_from_another_folder(wheel, tmp_path):
    """The issue's reproduction: `mpfa-warmup` of a fresh virtualenv holding only the wheel, run outside the
    checkout, compiles with nvcc every kernel a Llama-3.1-8B qk4pv8 server loads (append, decode,
    prefill), reading the templates the wheel installed."""
    venv = _fresh_venv(tmp_path / "venv", wheel)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in _AMBIENT}
    env.update(PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}", VIRTUAL_ENV=str(venv),
               MPFA_CACHE_DIR=str(tmp_path / "cache"))

    where = subprocess.run(
        [str(venv / "bin" / "python"), "-c",
         "import mpfa, mpfa_jit; from mpfa_jit.render import templates_dir; "
         "print(mpfa.__file__); print(mpfa_jit.__file__); print(templates_dir())"],
        cwd=elsewhere, env=env, capture_output=True, text=True)
    assert where.returncode == 0, where.stderr
    for path in where.stdout.split():
        assert Path(path).resolve().is_relative_to(venv.resolve()), f"{path} is not the installed wheel's"

    r = subprocess.run([str(venv / "bin" / "mpfa-warmup"), *SERVER, "--no-progress"], cwd=elsewhere, env=env,
                       capture_output=True, text=True)
    summary = re.search(r"^(\d+) of (\d+) ready", r.stdout, re.M)
    assert r.returncode == 0 and summary and summary[1] == summary[2], \
        f"warmup from the installed wheel failed (exit {r.returncode}):\n{r.stdout}\n{r.stderr[-4000:]}"
    # The table's rows (key, status, seconds): each op compiled here, none taken from a cache.
    rows = dict(re.findall(r"^(\S+)\s+(built|cached|FAILED)\s+[\d.]+$", r.stdout, re.M))
    assert len(rows) == int(summary[2]) and set(rows.values()) == {"built"}, r.stdout
    for op in ("append_kv_", "decode_", "prefill_"):
        assert any(key.startswith(op) for key in rows), f"no {op} kernel built:\n{r.stdout}"


# A compile test on its own, run by a pytest of its own under tests/conftest.py.
_NVCC_TEST = textwrap.dedent("""\
    import pytest

    @pytest.mark.nvcc
    def test_compiles():
        pass
""")


def _run_nvcc_test(tmp_path: Path, **env) -> subprocess.CompletedProcess:
    shutil.copy(REPO / "tests" / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_compile.py").write_text(_NVCC_TEST)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    nvcc: needs nvcc\n    gpu: needs a GPU\n")
    environ = {k: v for k, v in os.environ.items() if k not in ("MPFA_REQUIRE_NVCC", "PYTHONPATH")}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", str(tmp_path)],
                          cwd=tmp_path, env={**environ, **env}, capture_output=True, text=True)


def test_compile_tests_fail_instead_of_skipping_where_nvcc_is_required(tmp_path):
    """.ci/run sets MPFA_REQUIRE_NVCC=1 where the machine has nvcc: then a compile test whose nvcc cannot be
    found fails with the reason, so CI goes red instead of green with every compile test skipped."""
    r = _run_nvcc_test(tmp_path, MPFA_NVCC="/nonexistent", MPFA_REQUIRE_NVCC="1")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "1 error" in r.stdout and "skipped" not in r.stdout, r.stdout
    assert "MPFA_NVCC='/nonexistent' is not an executable file" in r.stdout
    assert "MPFA_REQUIRE_NVCC" in r.stdout


def test_compile_tests_skip_with_the_reason_where_nvcc_is_not_required(tmp_path):
    r = _run_nvcc_test(tmp_path, MPFA_NVCC="/nonexistent")
    assert r.returncode == 0 and "1 skipped" in r.stdout, r.stdout + r.stderr
    assert "MPFA_NVCC='/nonexistent' is not an executable file" in r.stdout
