"""Parallel builds for a warmup: build many kernel specializations at once with a progress bar, and the summary
table. The command that builds what an mpfa SGLang server loads is ``python -m mpfa.sglang.warmup`` (it mirrors
the server's settings and model checks, so it lives with the server code)."""
from __future__ import annotations

import contextlib
import logging
import os
import queue
import sys
import threading

from tqdm import tqdm

from . import build_only, env


def default_arch() -> str:
    if os.environ.get("MPFA_CUDA_ARCH"):
        return env.target_arch()
    try:
        import torch
        if torch.cuda.is_available():
            return env.target_arch(torch.cuda.current_device())
    except ImportError:
        pass
    return env.SUPPORTED_ARCHS[0]


class _BarHandler(logging.Handler):
    """Writes log records above a tqdm bar (the bar's own write), so a record never lands inside it."""

    def __init__(self, bar: tqdm):
        super().__init__()
        self.bar = bar
        self.setFormatter(logging.Formatter("%(message)s"))

    def emit(self, record):
        try:
            # a disabled bar (--no-progress) never sets .fp: its records go to stderr as plain lines
            self.bar.write(self.format(record), file=getattr(self.bar, "fp", None) or sys.stderr)
        except Exception:
            self.handleError(record)


@contextlib.contextmanager
def logs_above(bar: tqdm, logger: logging.Logger | None = None):
    """While the bar is shown, ``logger``'s records (default: the mpfa_jit logger, e.g. "built ... in 12 s")
    go through :class:`_BarHandler` instead of its own handlers."""
    logger = logger or logging.getLogger("mpfa_jit")
    saved = logger.handlers[:]
    logger.handlers = [_BarHandler(bar)]
    try:
        yield
    finally:
        logger.handlers = saved


def warmup(specs, jobs: int, progress: bool = True):
    """Build ``specs`` with ``jobs`` builds at once. Returns rows (key, status, seconds, error).

    The builders are daemon threads: on KeyboardInterrupt no further build starts and the interrupt
    propagates at once; when the process then exits, each running build's ninja receives SIGTERM
    (mpfa_jit.build) and stops its compilers, and the next build of that key clears what it left."""
    todo, done = queue.SimpleQueue(), queue.SimpleQueue()
    for s in specs:
        todo.put(s)

    def builder():
        while True:
            try:
                spec = todo.get_nowait()
            except queue.Empty:
                return
            try:
                _, built, seconds = build_only(spec)
                done.put((spec.key, "built" if built else "cached", seconds, ""))
            except Exception as e:   # one failed key must not hide the others' results
                done.put((spec.key, "FAILED", 0.0, f"{type(e).__name__}: {e}"))

    rows = {}
    bar = tqdm(total=len(specs), desc="mpfa warmup", unit="kernel", disable=not progress, file=sys.stderr)
    try:
        with logs_above(bar):
            for i in range(min(jobs, len(specs))):
                threading.Thread(target=builder, name=f"mpfa-warmup-{i}", daemon=True).start()
            for _ in specs:
                row = done.get()
                rows[row[0]] = row
                bar.update(1)
    except BaseException:
        while not todo.empty():   # start nothing more
            todo.get_nowait()
        raise
    finally:
        bar.close()
    return [rows[s.key] for s in specs]


def format_table(rows) -> str:
    width = max([len("key")] + [len(r[0]) for r in rows])
    lines = [f"{'key':<{width}}  {'status':<6}  {'seconds':>7}", f"{'-' * width}  ------  -------"]
    lines += [f"{k:<{width}}  {st:<6}  {sec:7.2f}" for k, st, sec, _ in rows]
    return "\n".join(lines)


if __name__ == "__main__":   # the command moved beside the server code it mirrors
    print("python -m mpfa_jit.warmup: the warmup command is python -m mpfa.sglang.warmup (or mpfa-warmup)",
          file=sys.stderr)
    sys.exit(2)
