"""Which rows of an end-to-end results file were measured in one run, so that every ratio pairs rows of one run.

A device session is short (30 minutes), so a results file fills over several sessions: one measures mpfa and
SGLang's fa3 FP8-KV backend, a later one mpfa again with the fa3 BF16 backend. A ratio may only pair rows measured
on one machine in one session: the same GPU, driver state and build. Each row carries ``run``, the same for every
call made on one machine at one commit (the environment's ``MPFA_RUN`` overrides it). Rows from before the stamp
fall back to their commit: each device session so far ran its own commit.

When a configuration is measured again, its new row replaces the old one (the file keeps the newest row of each
configuration and load), except an old row of the headline configuration that another configuration's kept row
was measured with: that pair's ratio stays in the file until the partner itself is measured again.
"""
from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Callable

RUN_ENV = "MPFA_RUN"


def current(commit: str | None) -> str:
    """This process's run: ``MPFA_RUN``, else ``<commit>@<host>/<boot>`` (one machine at one commit)."""
    named = os.environ.get(RUN_ENV)
    if named:
        return named
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()[:8]
    except OSError:
        boot = "?"
    return f"{str(commit or '?')[:7]}@{socket.gethostname()}/{boot}"


def run_of(row: dict) -> str | None:
    """The run a row was measured in: its ``run``, else its commit's first seven digits, else None (not known)."""
    if row.get("run"):
        return row["run"]
    return str(row["commit"])[:7] if row.get("commit") else None


def partner(headline_rows: list[dict], row: dict) -> dict | None:
    """The headline row (of ``headline_rows``, oldest first, all at ``row``'s place) that ``row``'s ratio pairs
    with: the newest of ``row``'s run, or for a row of no known run the newest of all; None if its run has none."""
    run = run_of(row)
    same = [h for h in headline_rows if run is None or run_of(h) == run]
    return same[-1] if same else None


def merge(previous: list[dict], new: list[dict], key: Callable[[dict], tuple],
          place: Callable[[dict], tuple | None], headline: str) -> list[dict]:
    """The rows after a run, oldest first: ``new`` replaces the rows of ``previous`` with the same ``key``, except
    an earlier ``headline`` row still paired (``partner``) with a row of another configuration at its ``place``;
    an earlier headline row neither the newest at its place nor paired is dropped. Rows whose ``place`` is None
    are never paired: the newest of each key stays."""
    fresh = {key(r) for r in new}

    def pairable_headline(r: dict) -> bool:
        return r.get("config") == headline and place(r) is not None

    rows = [r for r in previous if key(r) not in fresh or pairable_headline(r)] + new
    out = []
    for r in rows:
        if not pairable_headline(r):
            out.append(r)
            continue
        at_place = [h for h in rows if pairable_headline(h) and place(h) == place(r)]
        peers = [p for p in rows if not pairable_headline(p) and place(p) == place(r)]
        if r is at_place[-1] or any(partner(at_place, p) is r for p in peers):
            out.append(r)
    return out
