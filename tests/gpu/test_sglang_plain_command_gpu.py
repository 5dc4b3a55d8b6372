"""The plain command serves mpfa's measured configuration (issue 32 item 3; H200, SGLang 0.5.17; skipped where
SGLang is not importable):

    python -m sglang.launch_server --model-path server_configs/models/llama-3.1-8b --attention-backend mpfa \
        --load-format dummy --skip-tokenizer-init            (+ --port: nothing about pages or prefill graphs)

The plugin must choose the page size (16, logged: mpfa decodes fastest there) and apply mpfa's prefill CUDA
graph policy (settings.PREFILL_CUDA_GRAPH of the recipe, logged), with no extra flag, and the server must answer one
``/generate`` of a few hundred input_ids with 16 tokens. The recipe is the default (qk4pv8): the server's
environment carries no MPFA_* setting (benchmarks.e2e.server.server_env keeps only MPFA_CACHE_DIR).

Runtime: ~60-90 s for the server (dummy 8B weights, decode CUDA graphs) with mpfa's kernels already built
(``python -m mpfa.sglang.warmup --model-path server_configs/models/llama-3.1-8b --page-size 16``); a cold kernel
cache adds their build.
"""
import json
import random
import socket
import sys
import urllib.request
from pathlib import Path

import pytest

pytestmark = [pytest.mark.gpu]

pytest.importorskip("sglang", reason="SGLang is not installed (pip install -e '.[sglang]' on the H200)")

from benchmarks.e2e.server import Server, server_env, server_info  # noqa: E402
from mpfa.sglang import plugin, settings  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "server_configs/models/llama-3.1-8b"
INPUT_LEN, NEW_TOKENS = 300, 16
STARTUP_TIMEOUT_S = 420


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def plain_server(tmp_path_factory):
    port = _free_port()
    argv = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(MODEL), "--attention-backend", "mpfa",
            "--load-format", "dummy", "--skip-tokenizer-init", "--port", str(port)]
    log = tmp_path_factory.mktemp("plain") / "server.log"
    with Server(argv, server_env(HF_HUB_OFFLINE="1"), log, port, startup_timeout=STARTUP_TIMEOUT_S) as server:
        yield server, log


def _log_tail(log: Path, n: int = 3000) -> str:
    return log.read_text(errors="replace")[-n:]


def test_plain_command_serves(plain_server):
    server, log = plain_server
    ids = [random.Random(0).randrange(100, 30000) for _ in range(INPUT_LEN)]
    body = json.dumps({"input_ids": ids, "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0.0,
                                                              "ignore_eos": True}}).encode()
    req = urllib.request.Request(f"{server.base}/generate", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        status, out = r.status, json.loads(r.read().decode())
    assert status == 200
    assert len(out["output_ids"]) == NEW_TOKENS, (out, _log_tail(log))


def test_plain_command_logs_mpfa_choices(plain_server):
    server, log = plain_server
    text = log.read_text(errors="replace")
    page_line = plugin.PAGE_SIZE_LOG.split("%d")[0] + f"{settings.DEFAULT_PAGE_SIZE} ("
    assert page_line in text, f"no '{page_line}' line in the server log:\n{_log_tail(log)}"
    keep = settings.PREFILL_CUDA_GRAPH[settings.DEFAULT_RECIPE]   # the server's environment sets no MPFA_*
    state = "on:" if keep else "off:"
    graph_line = plugin.PREFILL_GRAPH_LOG % state
    assert graph_line in text, f"no '{graph_line}' line in the server log:\n{_log_tail(log)}"
    info = server_info(server.base)
    assert info["page_size"] == settings.DEFAULT_PAGE_SIZE
    assert info["disable_prefill_cuda_graph"] is (not keep)
    assert info["attention_backend"] == "mpfa"
