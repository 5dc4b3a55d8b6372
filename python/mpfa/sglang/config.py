"""mpfa settings for SGLang, the model checks and the launch command (pure Python: no SGLang, no GPU).

Where each setting comes from, highest precedence first:

1. environment variables: ``MPFA_RECIPE``, ``MPFA_COMPENSATION``, ``MPFA_PAGE_SIZE``, ``MPFA_KERNEL_BACKEND``;
2. the ``mpfa:`` section of the server config YAML named by ``MPFA_CONFIG`` (``python -m mpfa.sglang.launch``
   sets it), keys ``recipe``, ``compensation``, ``page_size``, ``kernel_backend``;
3. defaults: recipe ``qk4pv8``, compensation on, page size = SGLang's ``--page-size``, kernel backend ``auto``.

SGLang's ``--page-size`` is what the server really uses: a page size resolved from 1. or 2. that differs
from it is an error, never silently replaced. SGLang scheduler processes inherit the launcher's
environment, so every process resolves the same settings.
"""
from __future__ import annotations

import json
import os
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

import yaml

from mpfa_jit import server_config as _server_config
from mpfa_jit.ops import decode as _decode_op

from ..kv_cache import HEAD_DIMS, PAGE_SIZES
from ..recipes import DEFAULT_RECIPE, RECIPES, get_recipe

BACKEND_NAME = "mpfa"

ENV_RECIPE = "MPFA_RECIPE"
ENV_COMPENSATION = "MPFA_COMPENSATION"
ENV_PAGE_SIZE = "MPFA_PAGE_SIZE"
ENV_KERNEL_BACKEND = "MPFA_KERNEL_BACKEND"
ENV_CONFIG = "MPFA_CONFIG"
ENV_VARS = (ENV_RECIPE, ENV_COMPENSATION, ENV_PAGE_SIZE, ENV_KERNEL_BACKEND, ENV_CONFIG)

KERNEL_BACKENDS = ("auto", "reference")   # "reference": the PyTorch oracle, by name only (debugging)
DECODE_HEAD_DIMS = tuple(_decode_op.HEAD_DIMS)
MAX_GROUP_SIZE = max(_decode_op.GROUP_SIZES)
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


class MpfaConfigError(ValueError):
    """A bad mpfa setting (environment, YAML or server argument)."""


class UnsupportedModelError(ValueError):
    """The model (or an attention feature it uses) is one mpfa does not serve: raised before any
    forward pass, so it never produces wrong output."""


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


def _parse_recipe(name: str, value) -> str:
    if value not in RECIPES:
        raise MpfaConfigError(f"{name} must be one of {list(RECIPES)}, got {value!r}")
    return value


def _parse_page_size(name: str, value) -> int:
    try:
        p = int(str(value).strip()) if not isinstance(value, bool) else None
    except ValueError:
        p = None
    if p not in PAGE_SIZES:
        raise MpfaConfigError(f"{name} must be one of {list(PAGE_SIZES)}, got {value!r}")
    return p


def _parse_kernel_backend(name: str, value) -> str:
    if value not in KERNEL_BACKENDS:
        raise MpfaConfigError(f"{name} must be one of {list(KERNEL_BACKENDS)}, got {value!r}")
    return value


_PARSERS = {"recipe": _parse_recipe, "compensation": parse_bool, "page_size": _parse_page_size,
            "kernel_backend": _parse_kernel_backend}
_ENV_OF = {"recipe": ENV_RECIPE, "compensation": ENV_COMPENSATION, "page_size": ENV_PAGE_SIZE,
           "kernel_backend": ENV_KERNEL_BACKEND}
_YAML_KEYS = ("recipe", "compensation", "page_size", "kernel_backend", "prefill_cuda_graph")


def read_yaml_mpfa_section(path: "str | Path") -> dict:
    """The ``mpfa:`` section of a server config YAML (unknown keys are an error)."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError:
        raise MpfaConfigError(f"{ENV_CONFIG}={path}: no such server config file") from None
    section = dict(data.get("mpfa") or {})
    unknown = sorted(set(section) - set(_YAML_KEYS))
    if unknown:
        raise MpfaConfigError(f"{path}: unknown keys in the mpfa section: {unknown}; accepted: {list(_YAML_KEYS)}")
    return section


def resolve_settings(*, server_page_size: int | None = None, env: Mapping[str, str] | None = None,
                     yaml_section: Mapping | None = None, yaml_path: str | None = None) -> MpfaSettings:
    """Resolve the settings with the documented precedence: environment > YAML ``mpfa:`` section >
    defaults. ``yaml_section`` defaults to the file named by ``MPFA_CONFIG`` in ``env`` (if any).
    ``server_page_size`` is SGLang's ``--page-size``; a different resolved page size raises."""
    env = os.environ if env is None else env
    if yaml_section is None and env.get(ENV_CONFIG):
        yaml_path = env[ENV_CONFIG]
        yaml_section = read_yaml_mpfa_section(yaml_path)
    yaml_section = dict(yaml_section or {})
    defaults = {"recipe": DEFAULT_RECIPE, "compensation": True, "page_size": server_page_size, "kernel_backend": "auto"}
    values, sources = {}, {}
    for key in ("recipe", "compensation", "page_size", "kernel_backend"):
        env_name = _ENV_OF[key]
        if env.get(env_name, "") != "":
            values[key], sources[key] = _PARSERS[key](env_name, env[env_name]), f"env {env_name}"
        elif yaml_section.get(key) is not None:
            where = f"yaml {yaml_path}" if yaml_path else "yaml"
            values[key], sources[key] = _PARSERS[key](f"mpfa.{key} ({where})", yaml_section[key]), where
        else:
            values[key], sources[key] = defaults[key], "default"
    if server_page_size is not None:
        server_page_size = _parse_page_size("SGLang --page-size (mpfa pages)", server_page_size)
        if values["page_size"] != server_page_size:
            raise MpfaConfigError(
                f"mpfa page size {values['page_size']} (from {sources['page_size']}) differs from SGLang's "
                f"--page-size {server_page_size}: pass --page-size {values['page_size']} or change the mpfa setting")
        if sources["page_size"] == "default":
            sources["page_size"] = "sglang --page-size"
    if values["page_size"] is None:
        raise MpfaConfigError(f"no page size: set SGLang's --page-size (one of {list(PAGE_SIZES)}) or {ENV_PAGE_SIZE}")
    return MpfaSettings(values["recipe"], values["compensation"], values["page_size"], values["kernel_backend"], sources)


# ---------------------------------------------------------------------------------------------------------------
# What mpfa serves. Pure functions of plain values, so they run (and are tested) without SGLang.
# ---------------------------------------------------------------------------------------------------------------

def check_model_supported(*, head_dim: int, num_qo_heads: int, num_kv_heads: int, page_size: int, recipe: str,
                          v_head_dim: int | None = None, use_mla: bool = False, sliding_window: int | None = None,
                          logit_cap: float = 0.0, is_encoder_decoder: bool = False, is_cross_attention: bool = False,
                          attn_type: str = "decoder", hybrid: str | None = None, what: str = "model") -> None:
    """Raise :class:`UnsupportedModelError` naming the first thing mpfa cannot serve. ``num_*_heads`` are
    per GPU (after tensor parallelism). ``attn_type``: SGLang's AttentionType value ("decoder", ...).
    ``hybrid``: a description of a hybrid architecture (Mamba, linear attention, hybrid SWA), or None."""
    def fail(msg):
        raise UnsupportedModelError(f"--attention-backend mpfa cannot serve this {what}: {msg}")

    if use_mla:
        fail("multi-head latent attention (MLA, e.g. DeepSeek) is not supported; mpfa serves MHA/GQA/MQA")
    if hybrid:
        fail(f"hybrid architecture ({hybrid}) is not supported; mpfa serves full-attention decoder models")
    if is_encoder_decoder or is_cross_attention:
        fail("cross attention (encoder-decoder models) is not supported")
    if attn_type not in ("decoder", None):
        fail(f"attention type {attn_type!r} is not supported (encoder-only and bidirectional attention are not); "
             "mpfa serves causal decoder self-attention")
    if sliding_window is not None and sliding_window > 0:
        fail(f"sliding-window attention (window {sliding_window}) is not supported")
    if logit_cap and logit_cap > 0:
        fail(f"attention logit soft cap ({logit_cap}) is not supported")
    if v_head_dim is not None and v_head_dim != head_dim:
        fail(f"V head_dim {v_head_dim} differs from the QK head_dim {head_dim}")
    if head_dim not in HEAD_DIMS or head_dim not in DECODE_HEAD_DIMS:
        fail(f"head_dim {head_dim} is not supported: the decode kernel is built for head_dim {list(DECODE_HEAD_DIMS)}")
    if num_kv_heads <= 0 or num_qo_heads <= 0 or num_qo_heads % num_kv_heads:
        fail(f"num_qo_heads {num_qo_heads} must be a positive multiple of num_kv_heads {num_kv_heads}")
    if num_qo_heads // num_kv_heads > MAX_GROUP_SIZE:
        fail(f"GQA group size {num_qo_heads // num_kv_heads} (query heads per KV head) is above {MAX_GROUP_SIZE}")
    if page_size not in PAGE_SIZES:
        fail(f"page size {page_size} is not supported: pass --page-size one of {list(PAGE_SIZES)}")
    if recipe not in RECIPES:
        fail(f"recipe {recipe!r} is unknown: one of {list(RECIPES)}")


def hf_config_facts(cfg: Mapping, *, tp_size: int = 1) -> dict:
    """The attention facts of a HuggingFace config.json dict that :func:`check_model_supported` takes."""
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    layer_types = cfg.get("layer_types") or ()
    sliding = None
    if cfg.get("sliding_window") and (cfg.get("use_sliding_window", True) or "sliding_attention" in layer_types):
        sliding = int(cfg["sliding_window"])
    hybrid = None
    if any(t not in ("full_attention", "sliding_attention") for t in layer_types):
        hybrid = f"layer types {sorted(set(layer_types))}"
    elif cfg.get("mamba_d_state") or cfg.get("linear_num_key_heads") or cfg.get("hybrid_override_pattern"):
        hybrid = "Mamba / linear-attention layers"
    return dict(
        head_dim=int(head_dim), v_head_dim=int(cfg.get("v_head_dim") or head_dim),
        num_qo_heads=heads // tp_size, num_kv_heads=max(1, kv_heads // tp_size),
        use_mla=bool(cfg.get("kv_lora_rank")), sliding_window=sliding,
        logit_cap=float(cfg.get("attn_logit_softcapping") or 0.0),
        is_encoder_decoder=bool(cfg.get("is_encoder_decoder")), hybrid=hybrid)


def check_hf_config(cfg: Mapping, *, page_size: int, recipe: str, tp_size: int = 1) -> dict:
    facts = hf_config_facts(cfg, tp_size=tp_size)
    arch = ",".join(cfg.get("architectures") or ["?"])
    check_model_supported(page_size=page_size, recipe=recipe, what=f"model ({arch})", **facts)
    return facts


# ---------------------------------------------------------------------------------------------------------------
# The launch command from a server config YAML.
# ---------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class LaunchPlan:
    argv: list
    env: dict            # the variables to set (on top of the current environment)
    settings: MpfaSettings
    config: "_server_config.ServerConfig"

    def shell(self) -> str:
        envs = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        return f"{envs} {shlex.join(self.argv)}".strip()


def _flag(key: str) -> str:
    key = str(key)
    return key if key.startswith("--") else "--" + key.replace("_", "-")


def sglang_args(options: Mapping) -> list:
    """``{key: value}`` -> ``--key value`` (True -> ``--key``, False/None -> omitted, list -> ``--key a b``)."""
    out = []
    for key, value in options.items():
        flag = _flag(key)
        if value is None or value is False:
            continue
        if value is True:
            out.append(flag)
        elif isinstance(value, (list, tuple)):
            out += [flag] + [str(v) for v in value]
        elif isinstance(value, dict):
            out += [flag, json.dumps(value)]
        else:
            out += [flag, str(value)]
    return out


def build_launch(config_path: "str | Path", *, extra_args=(), env: Mapping[str, str] | None = None,
                 python: str | None = None) -> LaunchPlan:
    """The ``python -m sglang.launch_server ...`` argument list and the MPFA_* environment for a server
    config. Validates the model against :func:`check_model_supported` first."""
    env = dict(os.environ if env is None else env)
    path = Path(config_path).resolve()
    if not path.is_file():
        raise MpfaConfigError(f"{config_path}: no such server config file")
    cfg = _server_config.load(path)
    options = {k.replace("_", "-"): v for k, v in cfg.sglang.items()}
    for bad in ("model-path", "model"):
        if bad in options:
            raise MpfaConfigError(f"{path}: give the model as the top-level 'model' key, not sglang.{bad}")
    backend = options.pop("attention-backend", BACKEND_NAME)
    if backend != BACKEND_NAME:
        raise MpfaConfigError(f"{path}: sglang.attention-backend is {backend!r}; this launcher serves "
                              f"--attention-backend {BACKEND_NAME}")
    for key in ("prefill-attention-backend", "decode-attention-backend"):
        if options.get(key) not in (None, BACKEND_NAME):
            raise MpfaConfigError(f"{path}: sglang.{key} must be {BACKEND_NAME} (or absent): the pool holds mpfa's "
                                  "compressed cache, which no other backend reads")
    section = read_yaml_mpfa_section(path)
    # The YAML's page size is mpfa.page_size or sglang.page-size (mpfa_jit.server_config checks they agree);
    # MPFA_PAGE_SIZE in the environment overrides it, and the launch passes the result as --page-size.
    settings = resolve_settings(env=env, yaml_section={**section, "page_size": cfg.page_size}, yaml_path=str(path))
    hf = json.loads((cfg.model_dir / "config.json").read_text())
    check_hf_config(hf, page_size=settings.page_size, recipe=settings.recipe, tp_size=int(options.get("tp-size", 1)))
    options["page-size"] = settings.page_size
    # Extend batches are planned on the host per batch: mpfa runs prefill eagerly unless the YAML asks otherwise.
    if "disable-prefill-cuda-graph" not in options and not section.get("prefill_cuda_graph", False):
        options["disable-prefill-cuda-graph"] = True
    argv = [python or sys.executable, "-m", "sglang.launch_server", "--model-path", str(cfg.model_dir),
            "--attention-backend", BACKEND_NAME] + sglang_args(options) + [str(a) for a in extra_args]
    new_env = {ENV_CONFIG: str(path), ENV_RECIPE: settings.recipe, ENV_COMPENSATION: "1" if settings.compensation else "0",
               ENV_PAGE_SIZE: str(settings.page_size), ENV_KERNEL_BACKEND: settings.kernel_backend,
               "HF_HUB_OFFLINE": env.get("HF_HUB_OFFLINE", "1")}
    plugins = env.get("SGLANG_PLUGINS", "")
    if plugins and BACKEND_NAME not in [p.strip() for p in plugins.split(",")]:
        new_env["SGLANG_PLUGINS"] = plugins + "," + BACKEND_NAME   # a whitelist without mpfa would skip the plugin
    return LaunchPlan(argv, new_env, settings, cfg)
