"""SGLang integration: ``--attention-backend mpfa``.

Importing this package does not import SGLang. ``plugin.register`` (the ``sglang.srt.plugins`` entry
point) registers the backend and the KV-pool hooks. Pure Python, no SGLang: ``settings`` (the server
config YAML and the MPFA_* settings), ``model`` (which models mpfa serves), ``kernels`` (the kernels a
server loads), ``launch`` (the launch command), ``compat`` (SGLang names, looked up late). ``backend`` and
``pool`` need SGLang and run in its processes.
"""
from .model import UnsupportedModelError, check_model_supported
from .page_table import KVLayoutError
from .settings import BACKEND_NAME, ENV_VARS, MpfaConfigError, MpfaSettings, load_server_config, resolve_settings

__all__ = ["BACKEND_NAME", "ENV_VARS", "KVLayoutError", "MpfaConfigError", "MpfaSettings", "UnsupportedModelError",
           "check_model_supported", "load_server_config", "resolve_settings"]
