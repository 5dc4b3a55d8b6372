"""mpfa's server settings and the server config YAML they come from (pure Python: no SGLang, no GPU).

A server config (server_configs/*.yaml)::

    model: models/llama-3.1-8b                 # a folder with config.json, relative to the YAML file
    sglang: {page-size: 16, tp-size: 1, ...}   # python -m sglang.launch_server --<key> <value>
    mpfa: {recipe: qk4pv8, compensation: true} # keys: recipe, compensation, kernel_backend, prefill_cuda_graph

Where each setting comes from, highest precedence first:

1. environment variables: ``MPFA_RECIPE``, ``MPFA_COMPENSATION``, ``MPFA_PAGE_SIZE``, ``MPFA_KERNEL_BACKEND``,
   ``MPFA_PREFILL_CUDA_GRAPH``;
2. the server config named by ``MPFA_CONFIG`` (``python -m mpfa.sglang.launch`` sets it): its ``mpfa:``
   section, and its page size ``sglang.page-size``;
3. defaults: recipe ``qk4pv8``, compensation on, page size = SGLang's ``--page-size``, kernel backend ``auto``,
   prefill CUDA graph :data:`PREFILL_CUDA_GRAPH` of the recipe.

A server started without ``--page-size`` (the plain ``python -m sglang.launch_server --attention-backend mpfa``)
serves :func:`served_page_size`: ``MPFA_PAGE_SIZE``, else the YAML's ``sglang.page-size``, else
:data:`DEFAULT_PAGE_SIZE` (the plugin sets SGLang's ``page_size`` to it and logs it). Whether SGLang's default
prefill CUDA graph stays on is :func:`resolve_prefill_cuda_graph` (the plugin turns it off itself when that
says no and the command line does not configure the prefill graph).

Every ``sglang:`` key must be a flag of ``python -m sglang.launch_server`` in SGLang 0.5.17 (recorded in
sglang_api.json; a near miss names the flag it resembles), other than ``model-path`` (the top-level ``model``)
and an attention backend other than mpfa; with ``enable-dp-attention``, ``dp-size`` must divide ``tp-size``.

The page size is stated once per YAML, as ``sglang.page-size`` (SGLang's ``--page-size``, the one the
server really uses); ``mpfa.page_size`` is an error saying so. A page size resolved from 1. or 2. that
differs from the server's ``--page-size`` is an error, never silently replaced. SGLang scheduler
processes inherit the launcher's environment, so every process resolves the same settings, and so does
``python -m mpfa.sglang.warmup``, through :func:`resolve_settings`.
"""
from __future__ import annotations

import difflib
import functools
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

import yaml

from mpfa_jit.ops import append_kv as _append_op

from ..recipes import DEFAULT_RECIPE, RECIPES, get_recipe

BACKEND_NAME = "mpfa"

ENV_RECIPE = "MPFA_RECIPE"
ENV_COMPENSATION = "MPFA_COMPENSATION"
ENV_PAGE_SIZE = "MPFA_PAGE_SIZE"
ENV_KERNEL_BACKEND = "MPFA_KERNEL_BACKEND"
ENV_CONFIG = "MPFA_CONFIG"
ENV_PREFILL_CUDA_GRAPH = "MPFA_PREFILL_CUDA_GRAPH"
ENV_VARS = (ENV_RECIPE, ENV_COMPENSATION, ENV_PAGE_SIZE, ENV_KERNEL_BACKEND, ENV_CONFIG, ENV_PREFILL_CUDA_GRAPH)

KERNEL_BACKENDS = ("auto", "reference")   # "reference": the PyTorch oracle, by name only (debugging)
PAGE_SIZES = _append_op.PAGE_SIZES        # every op serves the pages the cache holds (mpfa.sglang.model checks)
# The page size a server started without --page-size serves (SGLang's own default is 1): mpfa decodes fastest
# at 16. H200, docs/design/decode.md: qk4pv8 decode reads 0.86-0.88 of HBM bandwidth at page 16 against 0.62-0.65
# at page 1 (665 us against 480 us at 32 x 32K: a page-1 token is five pieces in five arrays, each its own burst),
# qk8pv8 0.89-0.91 against 0.80-0.84. 32 and 64 serve too; one decode run (3073af1,
# benchmarks/results/studies/decode_page1_record_h200.json, 32 x 32K) read them 2-7% faster than 16 (qk4pv8 0.93 / 0.95
# against 0.91, qk4pv4 0.77 / 0.78 against 0.73), not yet weighed end to end against a page's coarser prefix sharing.
DEFAULT_PAGE_SIZE = 16
# Per recipe: whether mpfa leaves SGLang's default prefill CUDA graph (0.5.17: "breakable", attention eager between
# captured segments) on when the command line does not configure the prefill graph. The H200 A/B decided each
# (python -m benchmarks.e2e.prefill_graph_ab: greedy tokens with the graph on and off, TTFT at 512-32K prompts;
# on when the tokens are the same and the TTFT geomean on/off is at most 1.0): bf16 0.867 and qk8pv8 0.875, on
# (eager 512-token prompts wait on the host: 33-43 ms against 20-24 ms captured; 2K-32K within +-4%); qk4pv8 1.006,
# off (benchmarks/results/studies/prefill_graph_ab*_h200.json). qk4pv4 has not run with it: off.
# MPFA_PREFILL_CUDA_GRAPH or the YAML's mpfa.prefill_cuda_graph override it.
PREFILL_CUDA_GRAPH = {"bf16": True, "qk8pv8": True, "qk4pv8": False, "qk4pv4": False}
assert set(PREFILL_CUDA_GRAPH) == set(RECIPES), "a prefill-graph policy for every recipe"
TOP_LEVEL_KEYS = ("model", "sglang", "mpfa")
SGLANG_VERSION = "0.5.17"   # the server flags a config's sglang: section is checked against (sglang_api.json)
# SGLang's long spellings of the flags mpfa reads: one name each in ServerConfig.sglang
SGLANG_ALIASES = {"tensor-parallel-size": "tp-size", "data-parallel-size": "dp-size"}
MPFA_KEYS = ("recipe", "compensation", "kernel_backend", "prefill_cuda_graph")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


class MpfaConfigError(ValueError):
    """A bad mpfa setting or server config (environment, YAML, model folder or command line)."""


@dataclass(frozen=True)
class MpfaSettings:
    recipe: str
    compensation: bool
    page_size: int
    kernel_backend: str = "auto"
    sources: dict = field(default_factory=dict, compare=False)   # setting -> "env MPFA_...", "yaml <path>", "default", "sglang --page-size"

    @property
    def recipe_obj(self):
        return get_recipe(self.recipe)

    def bytes_per_token_layer(self, num_kv_heads: int, head_dim: int) -> int:
        """KV-cache bytes one token of one layer stores: num_kv_heads * recipe.bytes_per_token_head(head_dim)."""
        return num_kv_heads * self.recipe_obj.bytes_per_token_head(head_dim)


def parse_bool(name: str, value) -> bool:
    if isinstance(value, bool):
        return value
    s = str(value).strip().lower()
    if s in _TRUE:
        return True
    if s in _FALSE:
        return False
    raise MpfaConfigError(f"{name} must be a boolean ({'/'.join(_TRUE)} or {'/'.join(_FALSE)}), got {value!r}")


def parse_recipe(name: str, value) -> str:
    if value not in RECIPES:
        raise MpfaConfigError(f"{name} must be one of {list(RECIPES)}, got {value!r}")
    return value


def _as_int(value) -> int | None:
    """The integer a YAML or environment value spells (never a bool), or None."""
    if isinstance(value, bool):
        return None
    try:
        return int(str(value).strip())
    except ValueError:
        return None


def parse_page_size(name: str, value) -> int:
    p = _as_int(value)
    if p not in PAGE_SIZES:
        raise MpfaConfigError(f"{name} must be one of {list(PAGE_SIZES)}, got {value!r}")
    return p


def parse_positive_int(name: str, value) -> int:
    n = _as_int(value)
    if n is None or n < 1:
        raise MpfaConfigError(f"{name} must be a positive integer, got {value!r}")
    return n


def parse_kernel_backend(name: str, value) -> str:
    if value not in KERNEL_BACKENDS:
        raise MpfaConfigError(f"{name} must be one of {list(KERNEL_BACKENDS)}, got {value!r}")
    return value


_PARSERS = {"recipe": parse_recipe, "compensation": parse_bool, "page_size": parse_page_size,
            "kernel_backend": parse_kernel_backend, "prefill_cuda_graph": parse_bool}
_ENV_OF = {"recipe": ENV_RECIPE, "compensation": ENV_COMPENSATION, "page_size": ENV_PAGE_SIZE,
           "kernel_backend": ENV_KERNEL_BACKEND}


# ---------------------------------------------------------------------------------------------------------------
# The server config YAML: read in one place.
# ---------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ServerConfig:
    path: Path          # the YAML, absolute
    model_dir: Path     # the model folder it names, absolute (not checked here: see mpfa.sglang.model)
    sglang: dict        # the sglang: section, keys as SGLang's flags without "--" ("page-size")
    mpfa: dict          # the mpfa: section, parsed (only the keys the YAML states)

    @property
    def page_size(self) -> int | None:
        return self.sglang.get("page-size")

    @property
    def tp_size(self) -> int:
        """The attention tensor-parallel size, which splits the heads: tp-size, divided by dp-size when
        enable-dp-attention is set (SGLang's attn_tp_size; load_server_config refuses a dp-size that does not
        divide it)."""
        tp = self.sglang.get("tp-size", 1)
        if self.sglang.get("enable-dp-attention"):
            return tp // self.sglang.get("dp-size", 1)
        return tp


@functools.lru_cache(maxsize=None)
def sglang_flags(version: str = SGLANG_VERSION) -> frozenset:
    """The flags (without ``--``) ``python -m sglang.launch_server`` takes in that SGLang version, as recorded from
    its source in sglang_api.json: checked without SGLang installed (the launcher and warmup run without it)."""
    api = json.loads((Path(__file__).with_name("sglang_api.json")).read_text())
    return frozenset(api["launch_server_flags"][version])


def check_sglang_section(path: Path, sglang: dict) -> dict:
    """The ``sglang:`` section as the launcher passes it to SGLang, or :class:`MpfaConfigError` naming the file
    and key: every key one of SGLang's server flags (a misspelled one would fail the server at start, or worse,
    a flag mpfa reads would silently keep its default), the model and attention backend stated where mpfa
    reads them, and the parallel sizes SGLang accepts. The launcher and warmup both read configs through
    :func:`load_server_config`, so they refuse the same files."""
    flags = sglang_flags()
    for key in sglang:
        if key not in flags:
            near = difflib.get_close_matches(key, sorted(flags), n=1, cutoff=0.8)
            hint = f"; did you mean sglang.{near[0]}?" if near else ""
            raise MpfaConfigError(f"{path}: sglang.{key} is not a flag of python -m sglang.launch_server (SGLang "
                                  f"{SGLANG_VERSION}){hint}")
    for alias, name in SGLANG_ALIASES.items():
        if alias in sglang:
            if name in sglang:
                raise MpfaConfigError(f"{path}: sglang.{name} and sglang.{alias} are one setting: keep one")
            sglang[name] = sglang.pop(alias)
    for bad in ("model-path", "model"):
        if bad in sglang:
            raise MpfaConfigError(f"{path}: give the model as the top-level 'model' key, not sglang.{bad}")
    backend = sglang.get("attention-backend", BACKEND_NAME)
    if backend != BACKEND_NAME:
        raise MpfaConfigError(f"{path}: sglang.attention-backend is {backend!r}; this launcher serves "
                              f"--attention-backend {BACKEND_NAME}")
    for key in ("prefill-attention-backend", "decode-attention-backend"):
        if sglang.get(key) not in (None, BACKEND_NAME):
            raise MpfaConfigError(f"{path}: sglang.{key} must be {BACKEND_NAME} (or absent): the pool holds mpfa's "
                                  "compressed cache, which no other backend reads")
    if "page-size" in sglang:
        sglang["page-size"] = parse_page_size(f"{path}: sglang.page-size", sglang["page-size"])
    for key in ("tp-size", "dp-size"):
        if key in sglang:
            sglang[key] = parse_positive_int(f"{path}: sglang.{key}", sglang[key])
    if sglang.get("enable-dp-attention") is not None:
        sglang["enable-dp-attention"] = parse_bool(f"{path}: sglang.enable-dp-attention",
                                                   sglang["enable-dp-attention"])
    tp, dp = sglang.get("tp-size", 1), sglang.get("dp-size", 1)
    # SGLang 0.5.17 asserts tp_size % dp_size == 0 under DP attention (server_args.py, _handle_data_parallelism) and
    # splits the heads over tp-size // dp-size attention ranks (layers/dp_attention.py): a remainder would fail the
    # server at start after mpfa had built kernels for a split that never runs.
    if sglang.get("enable-dp-attention") and tp % dp:
        raise MpfaConfigError(f"{path}: sglang.dp-size {dp} must divide sglang.tp-size {tp} with "
                              "sglang.enable-dp-attention (each DP attention group runs tp-size / dp-size ranks)")
    return sglang


def _mapping(path: Path, name: str, value) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise MpfaConfigError(f"{path}: {name} must be a mapping of keys to values, got {type(value).__name__}")
    return value


def load_server_config(path: "str | Path") -> ServerConfig:
    """Read and check a server config YAML: unknown keys, a bad value, or a page size stated in the
    ``mpfa:`` section raise :class:`MpfaConfigError` naming the file, the key and what is accepted."""
    path = Path(path)
    if not path.is_file():
        raise MpfaConfigError(f"{path}: no such server config file (see server_configs/*.yaml)")
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise MpfaConfigError(f"{path}: cannot be read ({e.strerror if isinstance(e, OSError) else e})") from None
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        at = f" at line {where.line + 1}, column {where.column + 1}" if where else ""
        raise MpfaConfigError(f"{path}: not valid YAML{at} ({getattr(e, 'problem', None) or e}): "
                              "fix the syntax") from None
    data = _mapping(path, "the file", data)
    unknown = sorted(set(data) - set(TOP_LEVEL_KEYS), key=str)
    if unknown:
        raise MpfaConfigError(f"{path}: unknown top-level keys {unknown}; accepted: {list(TOP_LEVEL_KEYS)}")
    if not isinstance(data.get("model"), str) or not data["model"]:
        raise MpfaConfigError(f"{path}: missing 'model' (a folder with config.json, relative to the config)")
    sglang = check_sglang_section(path, {str(k).removeprefix("--").replace("_", "-"): v
                                         for k, v in _mapping(path, "sglang", data.get("sglang")).items()})
    section = _mapping(path, "mpfa", data.get("mpfa"))
    if "page_size" in section:
        raise MpfaConfigError(f"{path}: mpfa.page_size: state the page size once, as sglang.page-size (SGLang's "
                              "--page-size, which mpfa follows); remove mpfa.page_size")
    unknown = sorted(set(section) - set(MPFA_KEYS), key=str)
    if unknown:
        raise MpfaConfigError(f"{path}: unknown keys in the mpfa section: {unknown}; accepted: {list(MPFA_KEYS)}")
    mpfa = {k: _PARSERS[k](f"{path}: mpfa.{k}", v) for k, v in section.items() if v is not None}
    return ServerConfig(path.resolve(), (path.parent / data["model"]).resolve(), sglang, mpfa)


# ---------------------------------------------------------------------------------------------------------------
# Resolution: environment > YAML > defaults.
# ---------------------------------------------------------------------------------------------------------------

def config_from_env(env: Mapping[str, str]) -> ServerConfig | None:
    """The server config ``MPFA_CONFIG`` names, or None when it is unset."""
    if not env.get(ENV_CONFIG):
        return None
    try:
        return load_server_config(env[ENV_CONFIG])
    except MpfaConfigError as e:
        raise MpfaConfigError(f"{ENV_CONFIG}={e}") from None


def served_page_size(env: Mapping[str, str] | None = None, config: ServerConfig | None = None) -> tuple[int, str]:
    """(page size, where it came from) of a server whose command line gives no ``--page-size``:
    ``MPFA_PAGE_SIZE``, else ``sglang.page-size`` of the YAML ``MPFA_CONFIG`` names (or ``config``), else
    :data:`DEFAULT_PAGE_SIZE`. The source reads as in :attr:`MpfaSettings.sources`."""
    env = os.environ if env is None else env
    return _resolve("page_size", env, config_from_env(env) if config is None else config, DEFAULT_PAGE_SIZE)


def resolve_prefill_cuda_graph(env: Mapping[str, str] | None = None,
                               config: ServerConfig | None = None) -> tuple[bool, str]:
    """(keep SGLang's default prefill CUDA graph on, where that came from): ``MPFA_PREFILL_CUDA_GRAPH``, else the
    YAML's ``mpfa.prefill_cuda_graph``, else its ``sglang.disable-prefill-cuda-graph: false`` (on: the flag the
    launcher leaves out), else :data:`PREFILL_CUDA_GRAPH` of the recipe the server runs. Only for a command line
    that does not configure the prefill graph itself (``--disable-prefill-cuda-graph``,
    ``--cuda-graph-backend-prefill``, ``--cuda-graph-config`` with a prefill backend): those always win
    (mpfa.sglang.plugin)."""
    env = os.environ if env is None else env
    if env.get(ENV_PREFILL_CUDA_GRAPH, "") != "":
        return parse_bool(ENV_PREFILL_CUDA_GRAPH, env[ENV_PREFILL_CUDA_GRAPH]), f"env {ENV_PREFILL_CUDA_GRAPH}"
    if config is None:
        config = config_from_env(env)
    if config is not None:
        if config.mpfa.get("prefill_cuda_graph") is not None:
            return config.mpfa["prefill_cuda_graph"], f"yaml {config.path}"
        flag = config.sglang.get("disable-prefill-cuda-graph")
        if flag is not None:
            return not parse_bool(f"{config.path}: sglang.disable-prefill-cuda-graph", flag), f"yaml {config.path}"
    recipe = _resolve("recipe", env, config, DEFAULT_RECIPE)[0]
    return PREFILL_CUDA_GRAPH[recipe], f"mpfa's default for {recipe}"


def _resolve(key: str, env: Mapping[str, str], config: ServerConfig | None, default):
    """(value, source) of one setting of _ENV_OF: its environment variable, else the YAML's mpfa: section
    (page_size: sglang.page-size), else ``default``."""
    name = _ENV_OF[key]
    if env.get(name, "") != "":
        return _PARSERS[key](name, env[name]), f"env {name}"
    if config is not None:
        from_yaml = config.page_size if key == "page_size" else config.mpfa.get(key)
        if from_yaml is not None:
            return from_yaml, f"yaml {config.path}"
    return default, "default"


def resolve_settings(*, server_page_size: int | None = None, env: Mapping[str, str] | None = None,
                     config: ServerConfig | None = None) -> MpfaSettings:
    """The settings, with the documented precedence: environment > the server config > defaults.
    ``config`` defaults to the file ``MPFA_CONFIG`` names in ``env``. ``server_page_size`` is SGLang's
    ``--page-size`` (None where no server runs yet: the launcher, warmup); a different resolved page size
    raises."""
    env = os.environ if env is None else env
    if config is None:
        config = config_from_env(env)
    defaults = {"recipe": DEFAULT_RECIPE, "compensation": True, "page_size": server_page_size, "kernel_backend": "auto"}
    values, sources = {}, {}
    for key in _ENV_OF:
        values[key], sources[key] = _resolve(key, env, config, defaults[key])
    if server_page_size is not None:
        server_page_size = parse_page_size("SGLang --page-size (mpfa pages)", server_page_size)
        if values["page_size"] != server_page_size:
            raise MpfaConfigError(
                f"mpfa page size {values['page_size']} (from {sources['page_size']}) differs from SGLang's "
                f"--page-size {server_page_size}: pass --page-size {values['page_size']} or change the mpfa setting")
        if sources["page_size"] == "default":
            sources["page_size"] = "sglang --page-size"
    if values["page_size"] is None:
        raise MpfaConfigError(f"no page size: set sglang.page-size in the server config, SGLang's --page-size, or "
                              f"{ENV_PAGE_SIZE} (one of {list(PAGE_SIZES)})")
    return MpfaSettings(values["recipe"], values["compensation"], values["page_size"], values["kernel_backend"],
                        sources)
