"""Launch SGLang with ``--attention-backend mpfa`` from a server config YAML.

    python -m mpfa.sglang.launch server_configs/llama-3.1-8b-qk4pv8.yaml            # exec the server
    python -m mpfa.sglang.launch server_configs/llama-3.1-8b-qk4pv8.yaml --print    # print the command only
    python -m mpfa.sglang.launch CONFIG -- --port 30001 --host 0.0.0.0              # extra SGLang arguments

The command is ``python -m sglang.launch_server --model-path <abs model dir> --attention-backend mpfa
--page-size <P> ...`` (every key of the YAML's ``sglang:`` section as ``--key value``); the environment adds
MPFA_CONFIG, MPFA_RECIPE, MPFA_COMPENSATION, MPFA_PAGE_SIZE, MPFA_KERNEL_BACKEND and HF_HUB_OFFLINE=1.
Environment variables already set override the YAML (see mpfa.sglang.settings). The prefill CUDA graph is
left to the plugin, which decides in the server as for a plain ``sglang.launch_server`` command (the YAML's
``mpfa.prefill_cuda_graph``, ``MPFA_PREFILL_CUDA_GRAPH``, else mpfa's default; mpfa.sglang.plugin).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from dataclasses import dataclass
from typing import Mapping

from .model import UnsupportedModelError, check_hf_config, read_hf_config
from .settings import (BACKEND_NAME, ENV_COMPENSATION, ENV_CONFIG, ENV_KERNEL_BACKEND, ENV_PAGE_SIZE, ENV_RECIPE,
                       MpfaConfigError, MpfaSettings, ServerConfig, load_server_config, resolve_prefill_cuda_graph,
                       resolve_settings)


@dataclass(frozen=True)
class LaunchPlan:
    argv: list
    env: dict            # the variables to set (on top of the current environment)
    settings: MpfaSettings
    config: ServerConfig

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


def server_settings(cfg: ServerConfig, env: Mapping[str, str]) -> tuple[MpfaSettings, dict]:
    """The settings and the model's attention facts (heads per GPU, head_dim: mpfa.sglang.model.hf_config_facts) of
    a server launched from ``cfg`` under ``env``, or the error the server would stop with. The launcher and
    ``python -m mpfa.sglang.warmup CONFIG`` both decide here, so warmup builds for exactly the configs that launch."""
    settings = resolve_settings(env=env, config=cfg)
    facts = check_hf_config(read_hf_config(cfg.model_dir), page_size=settings.page_size, recipe=settings.recipe,
                            tp_size=cfg.tp_size, where=str(cfg.model_dir / "config.json"))
    return settings, facts


def build_launch(config_path, *, extra_args=(), env: Mapping[str, str] | None = None,
                 python: str | None = None) -> LaunchPlan:
    """The ``python -m sglang.launch_server ...`` argument list and the MPFA_* environment for a server
    config. Checks the model against :func:`mpfa.sglang.model.check_model_supported` first."""
    env = dict(os.environ if env is None else env)
    cfg = load_server_config(config_path)   # refuses what SGLang or mpfa would (settings.check_sglang_section)
    path, options = cfg.path, dict(cfg.sglang)
    options.pop("attention-backend", None)  # mpfa, stated once below
    settings, _ = server_settings(cfg, env)
    options["page-size"] = settings.page_size
    # The prefill CUDA graph is the plugin's decision in the server (settings.resolve_prefill_cuda_graph, from
    # MPFA_PREFILL_CUDA_GRAPH or this YAML, which MPFA_CONFIG names), as for a plain sglang.launch_server command:
    # no flag here. Resolved once now so that a bad value stops the launcher, not the server.
    resolve_prefill_cuda_graph(env=env, config=cfg)
    argv = [python or sys.executable, "-m", "sglang.launch_server", "--model-path", str(cfg.model_dir),
            "--attention-backend", BACKEND_NAME] + sglang_args(options) + [str(a) for a in extra_args]
    new_env = {ENV_CONFIG: str(path), ENV_RECIPE: settings.recipe,
               ENV_COMPENSATION: "1" if settings.compensation else "0", ENV_PAGE_SIZE: str(settings.page_size), ENV_KERNEL_BACKEND: settings.kernel_backend,
               "HF_HUB_OFFLINE": env.get("HF_HUB_OFFLINE", "1")}
    plugins = env.get("SGLANG_PLUGINS", "")
    if plugins and BACKEND_NAME not in [p.strip() for p in plugins.split(",")]:
        new_env["SGLANG_PLUGINS"] = plugins + "," + BACKEND_NAME   # a whitelist without mpfa would skip the plugin
    return LaunchPlan(argv, new_env, settings, cfg)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(
        prog="python -m mpfa.sglang.launch", usage="%(prog)s CONFIG [--print] [-- SGLANG_ARGS ...]",
        description=__doc__.split("\n\n")[0],
        epilog="Arguments after -- go to python -m sglang.launch_server unchanged, after the config's own "
               "(e.g. -- --port 30001 --host 0.0.0.0). Settings: MPFA_RECIPE, MPFA_COMPENSATION, MPFA_PAGE_SIZE, "
               "MPFA_KERNEL_BACKEND, MPFA_PREFILL_CUDA_GRAPH override the YAML (docs/sglang.md).")
    p.add_argument("config", help="server config YAML (server_configs/*.yaml)")
    p.add_argument("--print", dest="print_only", action="store_true", help="print the command, do not run it")
    args = p.parse_args(argv)
    try:
        plan = build_launch(args.config, extra_args=extra)
    except (MpfaConfigError, UnsupportedModelError) as e:
        print(f"mpfa launch: error: {e}", file=sys.stderr)
        return 2
    for key, src in plan.settings.sources.items():
        if src.startswith("env "):
            print(f"note: {key}={getattr(plan.settings, key)!r} from the environment ({src[4:]}) overrides the YAML",
                  file=sys.stderr)
    if args.print_only:
        print(plan.shell())
        return 0
    env = {**os.environ, **plan.env}
    os.execvpe(plan.argv[0], plan.argv, env)   # does not return
    return 0   # pragma: no cover


if __name__ == "__main__":
    sys.exit(main())
