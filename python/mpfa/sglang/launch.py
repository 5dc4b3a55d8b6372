"""Launch SGLang with ``--attention-backend mpfa`` from a server config YAML.

    python -m mpfa.sglang.launch server_configs/llama-3.1-8b-qk4pv8.yaml            # exec the server
    python -m mpfa.sglang.launch server_configs/llama-3.1-8b-qk4pv8.yaml --print    # print the command only
    python -m mpfa.sglang.launch CONFIG -- --port 30001 --host 0.0.0.0              # extra SGLang arguments

The command is ``python -m sglang.launch_server --model-path <abs model dir> --attention-backend mpfa
--page-size <P> ...`` (every key of the YAML's ``sglang:`` section as ``--key value``); the environment adds
MPFA_CONFIG, MPFA_RECIPE, MPFA_COMPENSATION, MPFA_PAGE_SIZE, MPFA_KERNEL_BACKEND and HF_HUB_OFFLINE=1.
Environment variables already set override the YAML's ``mpfa:`` section (see mpfa.sglang.config).
"""
from __future__ import annotations

import argparse
import os
import sys

from .config import MpfaConfigError, UnsupportedModelError, build_launch


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(prog="python -m mpfa.sglang.launch", description=__doc__.split("\n\n")[0])
    p.add_argument("config", help="server config YAML (server_configs/*.yaml)")
    p.add_argument("--print", dest="print_only", action="store_true", help="print the command, do not run it")
    args = p.parse_args(argv)
    try:
        plan = build_launch(args.config, extra_args=extra)
    except (MpfaConfigError, UnsupportedModelError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
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
