"""An SGLang HTTP server in a child process group, and a streaming ``/generate`` client (stdlib only).

``Server`` starts ``python -m sglang.launch_server ...`` (or any argv), waits for ``/health`` and kills the
whole process group on exit. ``stream_generate`` sends one request with ``stream: true`` and records when
each chunk arrived, from which time to first token and inter-token latency follow; it can cancel the
request after a number of chunks by closing the connection (SGLang aborts a request whose client left).
"""
from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def server_env(**extra: str) -> dict:
    """The environment of a server this package starts: the caller's, without its MPFA_* settings (a
    configuration sets its own, e.g. MPFA_RECIPE) but keeping MPFA_CACHE_DIR (the prebuilt kernels),
    plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MPFA_") or k == "MPFA_CACHE_DIR"}
    # NVLink multicast stays off in every server (TP runs included) unless the caller set otherwise: the
    # shared GPU hosts these benchmarks run on forbid it, and every configuration then all-reduces alike.
    for k, v in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}.items():
        env.setdefault(k, v)
    env.update(extra)
    return env


def http_json(url: str, payload: dict | None = None, timeout: float = 120.0):
    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        body = r.read().decode()
    return json.loads(body) if body.strip().startswith(("{", "[")) else body


def flush_radix_cache(base: str, timeout_s: float = 60.0) -> None:
    """Empty the server's radix cache (SGLang's ``/flush_cache``), so a load's prompts hit nothing an earlier one
    left. SGLang flushes only when no request runs or waits; ``timeout_s`` lets the last ones drain. A refusal
    raises with SGLang's reason."""
    try:
        http_json(f"{base}/flush_cache?timeout={timeout_s:g}", {}, timeout=timeout_s + 30)
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"{base}/flush_cache refused (HTTP {e.code}): {e.read().decode(errors='replace')[:300]}") from None


def server_info(base: str) -> dict:
    try:
        return http_json(f"{base}/server_info")
    except OSError:   # SGLang versions before /server_info
        return http_json(f"{base}/get_server_info")


class Server:
    """``with Server(argv, env, log_path, port) as s:`` -> ``s.base`` answers; stopped on exit."""

    def __init__(self, argv: list[str], env: dict, log_path: Path, port: int, startup_timeout: float = 900.0):
        self.argv, self.env, self.log_path, self.port = argv, env, Path(log_path), port
        self.startup_timeout = startup_timeout
        self.base = f"http://127.0.0.1:{port}"
        self.proc = None
        self.startup_s = None

    def __enter__(self):
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.argv, cwd=REPO, env=self.env, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        t0 = time.perf_counter()
        while True:
            if self.proc.poll() is not None:
                self.__exit__(None, None, None)
                raise RuntimeError(f"the server exited with {self.proc.returncode} before answering "
                                   f"(log {self.log_path})")
            if time.perf_counter() - t0 > self.startup_timeout:
                self.__exit__(None, None, None)
                raise RuntimeError(f"no answer from {self.base}/health in {self.startup_timeout:.0f} s")
            try:
                http_json(f"{self.base}/health", timeout=5)
                break
            except OSError:
                time.sleep(2)
        self.startup_s = time.perf_counter() - t0
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def __exit__(self, *exc):
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()
        return False


@dataclass
class StreamResult:
    start: float                                     # perf_counter when the request was sent
    chunk_times: list = field(default_factory=list)  # perf_counter of each chunk with new tokens
    chunk_tokens: list = field(default_factory=list)  # cumulative output tokens at each such chunk
    output_ids: list = field(default_factory=list)
    error: str | None = None
    cancelled: bool = False

    @property
    def output_tokens(self) -> int:
        return self.chunk_tokens[-1] if self.chunk_tokens else 0

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.start if self.chunk_times else None

    def itls(self) -> list[float]:
        """Inter-token latencies: each chunk's gap spread over the tokens it brought."""
        out = []
        for (t0, n0), (t1, n1) in zip(zip(self.chunk_times, self.chunk_tokens),
                                      zip(self.chunk_times[1:], self.chunk_tokens[1:])):
            if n1 > n0:
                out += [(t1 - t0) / (n1 - n0)] * (n1 - n0)
        return out


def _tokens_so_far(out: dict, previous: int, incremental_ids: list) -> int:
    mi = out.get("meta_info") or {}
    if "completion_tokens" in mi:
        return int(mi["completion_tokens"])
    return previous + len(incremental_ids)


def stream_generate(port: int, input_ids: list[int], sampling_params: dict, *, cancel_after_chunks: int | None = None,
                    timeout: float = 3600.0) -> StreamResult:
    """One streamed ``/generate`` request; never raises (errors are recorded in the result)."""
    body = json.dumps({"input_ids": input_ids, "sampling_params": sampling_params, "stream": True}).encode()
    res = StreamResult(start=time.perf_counter())
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", "/generate", body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            res.error = f"HTTP {resp.status}: {resp.read(500).decode(errors='replace')}"
            return res
        chunks = 0
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                break
            out = json.loads(payload)
            if "error" in out:
                res.error = str(out["error"])[:500]
                break
            ids = out.get("output_ids") or []
            n = _tokens_so_far(out, res.output_tokens, ids)
            if n > res.output_tokens:
                res.chunk_times.append(time.perf_counter())
                res.chunk_tokens.append(n)
                res.output_ids = ids if len(ids) >= n else res.output_ids + ids
            chunks += 1
            if cancel_after_chunks is not None and chunks >= cancel_after_chunks:
                res.cancelled = True
                break
    except Exception as e:   # the row records it
        res.error = f"{type(e).__name__}: {e}"
    finally:
        conn.close()
    return res
