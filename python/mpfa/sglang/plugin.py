"""SGLang plugin: entry point ``mpfa = mpfa.sglang.plugin:register`` in group ``sglang.srt.plugins``.

SGLang's ``load_plugins()`` runs ``register()`` in the launcher and in every scheduler process, then
``HookRegistry.apply_hooks()``. ``register()``:

1. adds ``mpfa`` to ``--attention-backend``'s choices (``add_attention_backend_choices``),
2. registers the backend factory (``attention_registry.register_attention_backend("mpfa")``),
3. hooks the KV pool (``HookRegistry``, AROUND): ``KVCacheConfigurator._build_mha_kv_pool`` builds
   :class:`mpfa.sglang.pool.MpfaTokenToKVPool` and ``DefaultPoolConfigurator._compute_cell_size``
   returns mpfa's bytes per token (num_kv_heads * recipe.bytes_per_token_head(head_dim) per layer),
   so ``max_total_num_tokens`` counts the smaller cells. Both hooks pass through untouched unless the
   server's attention backend is mpfa.

Every SGLang name used is listed below (``SGLANG_NAMES``, ``HOOK_TARGETS``, ``RUNTIME_NAMES``);
``sglang_api.json`` records where each is defined in SGLang 0.5.17 and 0.5.23, and a CPU test checks
the lists against it. A name SGLang lacks raises :class:`SGLangCompatError` naming the version.
"""
from __future__ import annotations

import logging
import os

from .compat import SGLangCompatError, attn_tp_size, sglang_attr, sglang_version
from .model import check_model_supported
from .settings import BACKEND_NAME, ENV_VARS, MpfaConfigError, MpfaSettings, resolve_settings

logger = logging.getLogger(__name__)

# (module, name): what register() needs. SGLang 0.5.23 still exports every one (sglang_api.json).
SGLANG_NAMES = (
    ("sglang.srt.server_args", "add_attention_backend_choices"),
    ("sglang.srt.server_args", "ATTENTION_BACKEND_CHOICES"),
    ("sglang.srt.layers.attention.attention_registry", "register_attention_backend"),
    ("sglang.srt.plugins.hook_registry", "HookRegistry"),
    ("sglang.srt.plugins.hook_registry", "HookType"),
)
# HookRegistry targets (dotted paths to methods): version-specific, checked when the hooks apply.
HOOK_TARGETS = (
    "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._build_mha_kv_pool",
    "sglang.srt.model_executor.pool_configurator.DefaultPoolConfigurator._compute_cell_size",
)
# Used by the backend and the pool inside the scheduler process.
RUNTIME_NAMES = (
    ("sglang.srt.layers.attention.base_attn_backend", "AttentionBackend"),
    ("sglang.srt.mem_cache.memory_pool", "KVCache"),
    ("sglang.srt.runtime_context", "get_parallel"),
)
# AttentionBackend's CUDA-graph methods MpfaAttnBackend overrides (0.5.17 removed the legacy
# init_forward_metadata_capture_cuda_graph / replay_cuda_graph from the ABC).
GRAPH_METHODS = ("init_cuda_graph_state", "init_forward_metadata_out_graph", "init_forward_metadata_in_graph",
                 "get_cuda_graph_seq_len_fill_value")
ENTRY_POINT_GROUP = "sglang.srt.plugins"

_registered = False
_settings: dict[tuple, MpfaSettings] = {}   # (SGLang --page-size, MPFA_* values) -> the settings, resolved once


def mpfa_selected(server_args) -> bool:
    """True when the server's attention backend is mpfa for both prefill and decode; raises when only one
    of them is (the pool holds mpfa's compressed format, which no other backend can read)."""
    if hasattr(server_args, "get_attention_backends"):
        prefill, decode = server_args.get_attention_backends()
    else:
        prefill = getattr(server_args, "prefill_attention_backend", None) or server_args.attention_backend
        decode = getattr(server_args, "decode_attention_backend", None) or server_args.attention_backend
    if prefill == decode == BACKEND_NAME:
        return True
    if BACKEND_NAME in (prefill, decode):
        raise MpfaConfigError(f"the prefill and decode attention backends must both be {BACKEND_NAME} (got prefill="
                              f"{prefill!r}, decode={decode!r}): the KV pool holds mpfa's compressed cache")
    return False


def _settings_for(kvc) -> MpfaSettings:
    """The settings both pool hooks use (the pool then carries them to the backend)."""
    key = (kvc.page_size,) + tuple(os.environ.get(name) for name in ENV_VARS)
    if key not in _settings:
        _settings[key] = resolve_settings(server_page_size=kvc.page_size)
    return _settings[key]


def _check_configurator(kvc, settings):
    mc = kvc.model_config
    check_model_supported(
        head_dim=mc.head_dim, v_head_dim=getattr(mc, "v_head_dim", mc.head_dim),
        num_qo_heads=max(1, mc.num_attention_heads // attn_tp_size()),
        num_kv_heads=mc.get_num_kv_heads(attn_tp_size()), page_size=settings.page_size, recipe=settings.recipe,
        use_mla=bool(kvc.use_mla_backend), sliding_window=kvc.sliding_window_size,
        is_encoder_decoder=bool(getattr(mc, "is_encoder_decoder", False)),
        hybrid=("hybrid sliding-window attention" if getattr(kvc, "is_hybrid_swa", False) else
                "Mamba / linear attention" if getattr(kvc, "mambaish_config", None) else None))


def compute_cell_size_hook(original, configurator, kvc, num_layers, *args, **kwargs):
    """AROUND ``DefaultPoolConfigurator._compute_cell_size``: bytes per token over all layers."""
    if not mpfa_selected(kvc.server_args):
        return original(configurator, kvc, num_layers, *args, **kwargs)
    settings = _settings_for(kvc)
    _check_configurator(kvc, settings)
    cell = settings.bytes_per_token_layer(kvc.model_config.get_num_kv_heads(attn_tp_size()),
                                          kvc.model_config.head_dim) * int(num_layers)
    logger.info("mpfa: recipe %s stores %d bytes per token over %d layers", settings.recipe, cell, num_layers)
    return cell


def build_mha_kv_pool_hook(original, kvc, *args, **kwargs):
    """AROUND ``KVCacheConfigurator._build_mha_kv_pool``: the pool holds an mpfa PagedKVCache."""
    if not mpfa_selected(kvc.server_args):
        return original(kvc, *args, **kwargs)
    max_total_num_tokens = kwargs.get("max_total_num_tokens", args[0] if args else None)
    if max_total_num_tokens is None:
        raise SGLangCompatError(f"KVCacheConfigurator._build_mha_kv_pool of SGLang {sglang_version()} was called "
                                "without max_total_num_tokens; mpfa's pool hook needs it")
    settings = _settings_for(kvc)
    _check_configurator(kvc, settings)
    from .pool import MpfaTokenToKVPool
    info = kvc.layer_info
    return MpfaTokenToKVPool(
        max_total_num_tokens, page_size=settings.page_size, settings=settings,
        head_num=kvc.model_config.get_num_kv_heads(attn_tp_size()), head_dim=kvc.model_config.head_dim,
        layer_num=info.num_effective_layers, device=kvc.device, start_layer=info.start_layer,
        end_layer=info.end_layer, dtype=kvc.model_dtype)


def create_backend(model_runner):
    """The factory SGLang calls (``ATTENTION_BACKENDS["mpfa"](model_runner)``)."""
    from .backend import MpfaAttnBackend
    return MpfaAttnBackend(model_runner)


def register() -> None:
    """Zero-argument, idempotent plugin entry point (see the module docstring)."""
    global _registered
    if _registered:
        return
    names = {name: sglang_attr(module, name) for module, name in SGLANG_NAMES}
    if BACKEND_NAME not in names["ATTENTION_BACKEND_CHOICES"]:
        names["add_attention_backend_choices"]([BACKEND_NAME])
    names["register_attention_backend"](BACKEND_NAME)(create_backend)
    registry, around = names["HookRegistry"], names["HookType"].AROUND
    hooks = dict(zip(HOOK_TARGETS, (build_mha_kv_pool_hook, compute_cell_size_hook)))
    for target, hook in hooks.items():
        registry.register(target, hook, around)
    _registered = True
    logger.info("mpfa: registered --attention-backend %s and the KV-pool hooks (SGLang %s)", BACKEND_NAME,
                sglang_version())
