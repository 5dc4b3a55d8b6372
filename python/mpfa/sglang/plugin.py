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
4. hooks two steps of ``ServerArgs.__post_init__`` (AROUND, ``SERVER_ARGS_HOOK_TARGETS``) so that the plain
   ``python -m sglang.launch_server --model-path M --attention-backend mpfa`` serves the configuration mpfa
   measures, with one log line each: ``_handle_cuda_graph_config`` (turns SGLang's default prefill CUDA graph
   off when mpfa's policy, :func:`mpfa.sglang.settings.resolve_prefill_cuda_graph`, says so and the command
   line does not configure the prefill graph) and ``_handle_page_size`` (a server given no ``--page-size``
   serves :func:`mpfa.sglang.settings.served_page_size`, 16 by default, instead of SGLang's 1). SGLang
   0.5.23 resolves ServerArgs elsewhere (``sglang.srt.arg_groups.pipeline``) and has neither method: there
   register() skips them with a warning naming the flags to pass.

Every SGLang name used is listed below (``SGLANG_NAMES``, ``HOOK_TARGETS``, ``RUNTIME_NAMES``,
``SERVER_ARGS_HOOK_TARGETS``, ``SERVER_ARGS_NAMES``); ``sglang_api.json`` records where each is defined in
SGLang 0.5.17 and 0.5.23 (the ServerArgs ones: 0.5.17 only), and a CPU test checks the lists against it. A
name SGLang lacks raises :class:`SGLangCompatError` naming the version.
"""
from __future__ import annotations

import json
import logging
import os
import pkgutil

from .compat import SGLangCompatError, attn_tp_size, sglang_attr, sglang_version
from .model import check_model_supported
from .settings import (BACKEND_NAME, DEFAULT_PAGE_SIZE, ENV_PREFILL_CUDA_GRAPH, ENV_VARS, MpfaConfigError,
                       MpfaSettings, resolve_prefill_cuda_graph, resolve_settings, served_page_size)

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
# ServerArgs steps the plain command's defaults hang on (AROUND). SGLang 0.5.17's ServerArgs.__post_init__ calls
# _handle_cuda_graph_config (its _parse_cuda_graph_config derives cuda_graph_config from disable_prefill_cuda_graph
# and the other graph flags) long before _handle_page_size (the _page_size_default pass: None -> 1, after the
# attention backend is resolved). 0.5.23 has neither (sglang_api.json): register() skips them with a warning.
SERVER_ARGS_HOOK_TARGETS = (
    "sglang.srt.server_args.ServerArgs._handle_cuda_graph_config",
    "sglang.srt.server_args.ServerArgs._handle_page_size",
)
# Read by the page-size hook: ServerArgs as resolved so far (0.5.17 keeps the passes' declarations, e.g. a model
# override's page size, in a stash until __post_init__ ends). Missing: the hook reads the fields themselves.
SERVER_ARGS_NAMES = (
    ("sglang.srt.arg_groups.overrides", "resolved_view"),
)
# Log lines of the ServerArgs hooks (tests/gpu/test_sglang_plain_command_gpu.py looks for them in a server's log).
PAGE_SIZE_LOG = "mpfa: --page-size not given; serving page size %d (%s)"
PREFILL_GRAPH_LOG = "mpfa: prefill CUDA graph %s"
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


# --- ServerArgs hooks: the plain command's page size and prefill CUDA graph -----------------------------------------

def _backends(args) -> tuple:
    """(prefill, decode) attention backends of a ServerArgs (or a view of one) from its fields alone: no method
    call, which on SGLang's resolving view would read the half-built object instead of the view."""
    base = getattr(args, "attention_backend", None)
    return (getattr(args, "prefill_attention_backend", None) or base,
            getattr(args, "decode_attention_backend", None) or base)


def _mpfa_requested(args) -> bool:
    """:func:`mpfa_selected` for a half-built ServerArgs: True only when prefill and decode both name mpfa; never
    raises (a mix is refused, with its message, by the KV-pool hooks when the server builds its pool)."""
    return _backends(args) == (BACKEND_NAME, BACKEND_NAME)


def _resolving(server_args):
    """ServerArgs as resolved so far: SGLang 0.5.17's ``resolved_view`` (fields + the declarations of the passes
    that ran), or the object itself where SGLang has no such view."""
    try:
        view = sglang_attr(*SERVER_ARGS_NAMES[0])
    except SGLangCompatError:
        return server_args
    return view(server_args)


def _prefill_graph_flags(server_args) -> str | None:
    """How the command line configures the prefill CUDA graph itself (the flags SGLang 0.5.17's
    _parse_cuda_graph_config reads), or None where it leaves SGLang's default."""
    if getattr(server_args, "disable_cuda_graph", False):
        return "--disable-cuda-graph"
    if getattr(server_args, "disable_prefill_cuda_graph", False):
        return "--disable-prefill-cuda-graph"
    backend = getattr(server_args, "cuda_graph_backend_prefill", None)
    if backend is not None:
        return f"--cuda-graph-backend-prefill {backend}"
    raw = getattr(server_args, "cuda_graph_config", None)
    if hasattr(raw, "to_dict"):   # a CudaGraphConfig: its fields that differ from SGLang's defaults
        raw = raw.to_dict()
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except ValueError:
            raw = None
    prefill = raw.get("prefill") if isinstance(raw, dict) else None
    if isinstance(prefill, dict) and prefill.get("backend") is not None:
        return f"--cuda-graph-config prefill backend {prefill['backend']}"
    return None


def handle_cuda_graph_config_hook(original, server_args, *args, **kwargs):
    """AROUND ``ServerArgs._handle_cuda_graph_config``: with mpfa, unless the command line configures the prefill
    graph, SGLang's default prefill CUDA graph stays on or goes off as mpfa's policy says
    (settings.resolve_prefill_cuda_graph); off is ``disable_prefill_cuda_graph = True`` before SGLang derives its
    cuda_graph_config from it, exactly what ``--disable-prefill-cuda-graph`` does. Logs one line either way."""
    if _mpfa_requested(server_args):   # the fields as given: SGLang resolves the attention backend later
        flags = _prefill_graph_flags(server_args)
        if flags is not None:
            logger.info(PREFILL_GRAPH_LOG, f"as the command line sets it ({flags})")
        else:
            keep, source = resolve_prefill_cuda_graph()
            if keep:
                logger.info(PREFILL_GRAPH_LOG, f"on: SGLang's default prefill graph kept (mpfa prefill_cuda_graph "
                                               f"policy on, {source})")
            else:
                server_args.disable_prefill_cuda_graph = True
                logger.info(PREFILL_GRAPH_LOG, f"off: mpfa turned SGLang's default prefill graph off (mpfa "
                                               f"prefill_cuda_graph policy off, {source}; {ENV_PREFILL_CUDA_GRAPH}=1 "
                                               "keeps SGLang's default)")
    return original(server_args, *args, **kwargs)


def handle_page_size_hook(original, server_args, *args, **kwargs):
    """AROUND ``ServerArgs._handle_page_size``: with mpfa and no page size given (on the command line, nor declared
    by SGLang for the model), the server serves settings.served_page_size (MPFA_PAGE_SIZE, the page size of the
    YAML MPFA_CONFIG names, else DEFAULT_PAGE_SIZE) instead of SGLang's default 1, and logs it. A page size given
    is left as it is (the KV-pool hooks check it)."""
    view = _resolving(server_args)
    if view.page_size is None and _mpfa_requested(view):
        page, source = served_page_size()
        server_args.page_size = page   # before SGLang's _page_size_default pass, which then declares nothing
        why = (f"mpfa decodes fastest there: qk4pv8 reads 0.86-0.88 of HBM bandwidth at page {DEFAULT_PAGE_SIZE} "
               "against 0.62-0.65 at page 1; pass --page-size to choose" if source == "default" else f"from {source}")
        logger.info(PAGE_SIZE_LOG, page, why)
    return original(server_args, *args, **kwargs)


def _hook_target_exists(target: str) -> bool:
    try:
        pkgutil.resolve_name(target)
    except (ImportError, AttributeError, ValueError):
        return False
    return True


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
    server_hooks = dict(zip(SERVER_ARGS_HOOK_TARGETS, (
        (handle_cuda_graph_config_hook, "the prefill CUDA graph stays SGLang's default: pass "
                                        "--disable-prefill-cuda-graph for the configuration mpfa measures"),
        (handle_page_size_hook, f"a server given no --page-size runs SGLang's default: pass --page-size "
                                f"{DEFAULT_PAGE_SIZE}, where mpfa decodes fastest"))))
    for target, (hook, advice) in server_hooks.items():
        if _hook_target_exists(target):
            registry.register(target, hook, around)
        else:   # SGLang 0.5.23: ServerArgs resolution moved to sglang.srt.arg_groups.pipeline
            logger.warning("mpfa: SGLang %s has no %s, so %s (mpfa is tested with SGLang 0.5.17)", sglang_version(),
                           target, advice)
    _registered = True
    logger.info("mpfa: registered --attention-backend %s and the KV-pool hooks (SGLang %s)", BACKEND_NAME,
                sglang_version())
