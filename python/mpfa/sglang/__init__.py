"""SGLang integration: ``--attention-backend mpfa``.

Importing this package does not import SGLang. ``plugin.register`` (the ``sglang.srt.plugins`` entry
point) registers the backend and the KV-pool hooks; ``config`` holds the settings, the model checks
and the launch command (pure Python); ``backend``/``pool`` need SGLang and run in its processes.
"""
from .config import (BACKEND_NAME, ENV_VARS, MpfaConfigError, MpfaSettings, UnsupportedModelError,
                     check_model_supported, resolve_settings)

__all__ = ["BACKEND_NAME", "ENV_VARS", "MpfaConfigError", "MpfaSettings", "UnsupportedModelError",
           "check_model_supported", "resolve_settings"]
