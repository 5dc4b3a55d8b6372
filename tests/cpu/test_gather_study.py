"""The gather-granularity study's layouts (benchmarks/gather_granularity.py): every byte of a token read
exactly once, in aligned pieces a warp can hold, and the generated kernels compile for sm_90a."""
import shutil
import subprocess

import pytest

from benchmarks import gather_granularity as gg


@pytest.mark.parametrize("name", list(gg.LAYOUTS))
def test_pieces_cover_each_field_once_with_aligned_loads(name):
    fields = gg.LAYOUTS[name]
    ps = gg.pieces(fields)
    assert len(ps) <= 32
    for j, (stride, nbytes) in enumerate(fields):
        mine = sorted((o, w) for f, o, w in ps if f == j)
        covered = [b for o, w in mine for b in range(o, o + w)]
        assert covered == list(range(nbytes)), (name, j)
        assert all(o % w == 0 and stride % w == 0 and w in (4, 8, 16) for o, w in mine)


def test_more_than_a_warp_of_pieces_is_refused():
    with pytest.raises(ValueError, match="at most 32"):
        gg.pieces([(264, 260)])   # 8-byte stride: 33 pieces


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_kernels_compile(tmp_path):
    src = tmp_path / "g.cu"
    src.write_text(gg._kernel_source())
    subprocess.run(["nvcc", "-c", "-gencode", "arch=compute_90a,code=sm_90a", "-o", str(tmp_path / "g.o"), str(src)],
                   check=True)
