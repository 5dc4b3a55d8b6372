"""Which models mpfa serves: pure functions of plain values (a HuggingFace config.json, head counts), so
they run, and are tested, without SGLang. The launcher, warmup, the KV-pool hooks and the backend all
refuse through :func:`check_model_supported`, with the same message."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping

from mpfa_jit.ops import decode as _decode_op, prefill as _prefill_op, support as _support

from ..recipes import RECIPES
from .settings import MpfaConfigError, parse_positive_int


# What a server needs every kernel it runs to be built for: every op shares its head_dims and page sizes
# (mpfa_jit.ops.support); the GQA groups are the attention ops'.
HEAD_DIMS, PAGE_SIZES = _support.HEAD_DIMS, _support.PAGE_SIZES
GROUP_SIZES = tuple(g for g in _decode_op.GROUP_SIZES if g in _prefill_op.GROUP_SIZES)


class UnsupportedModelError(ValueError):
    """The model (or an attention feature it uses) is one mpfa does not serve: raised before any
    forward pass, so it never produces wrong output."""


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
    if head_dim not in HEAD_DIMS:
        fail(f"head_dim {head_dim} is not supported: the kernels are built for head_dim "
             f"{list(HEAD_DIMS)}")
    if (not isinstance(num_qo_heads, int) or not isinstance(num_kv_heads, int) or num_kv_heads <= 0
            or num_qo_heads <= 0 or num_qo_heads % num_kv_heads):
        fail(f"num_qo_heads {num_qo_heads} must be a positive multiple of num_kv_heads {num_kv_heads}")
    if num_qo_heads // num_kv_heads not in GROUP_SIZES:
        fail(f"GQA group size {num_qo_heads // num_kv_heads} (query heads per KV head) is above {max(GROUP_SIZES)}")
    if page_size not in PAGE_SIZES:
        fail(f"page size {page_size} is not supported: pass --page-size one of {list(PAGE_SIZES)}")
    if recipe not in RECIPES:
        fail(f"recipe {recipe!r} is unknown: one of {list(RECIPES)}")


def read_hf_config(model_dir: "str | Path") -> dict:
    """A model folder's config.json, or :class:`MpfaConfigError` saying what is missing and where."""
    model_dir = Path(model_dir)
    path = model_dir / "config.json"
    if not model_dir.is_dir():
        raise MpfaConfigError(f"model folder {model_dir} does not exist: give a folder with the model's config.json "
                              "(a server config's 'model' is relative to the config file)")
    if not path.is_file():
        raise MpfaConfigError(f"model folder {model_dir} has no config.json: copy the model's HuggingFace "
                              "config.json there")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise MpfaConfigError(f"{path}: not valid JSON at line {e.lineno}, column {e.colno} ({e.msg})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise MpfaConfigError(f"{path}: cannot be read ({e.strerror if isinstance(e, OSError) else e})") from None
    if not isinstance(cfg, dict):
        raise MpfaConfigError(f"{path}: must hold a JSON object (a HuggingFace model config)")
    return cfg


def _int_key(cfg: Mapping, key: str, where: str, *, positive: bool = False, required: bool = False) -> int | None:
    """``cfg[key]`` as an int (None when absent or null and not ``required``), or :class:`MpfaConfigError` naming
    the file and key: a string or a fraction there is a broken config, never a number to coerce."""
    value = cfg.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or (positive and value < 1):
        raise MpfaConfigError(f"{where}: {key} must be {'a positive' if positive else 'an'} integer"
                              f"{'' if required else ' or absent'}, got {value!r}")
    return value


def _number_key(cfg: Mapping, key: str, where: str) -> float:
    """``cfg[key]`` as a float (0 when absent or null), or :class:`MpfaConfigError` naming the file and key."""
    value = cfg.get(key)
    if value is None:
        return 0.0
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise MpfaConfigError(f"{where}: {key} must be a number or absent, got {value!r}")
    return float(value)


def hf_config_facts(cfg: Mapping, *, tp_size: int = 1, where: str = "config.json") -> dict:
    """The attention facts of a HuggingFace config.json dict that :func:`check_model_supported` takes
    (heads per GPU under ``tp_size``-way tensor parallelism). A field of the wrong type raises
    :class:`MpfaConfigError` naming ``where`` and the field."""
    tp_size = parse_positive_int("tp-size", tp_size)
    heads = _int_key(cfg, "num_attention_heads", where, positive=True, required=True)
    kv_heads = _int_key(cfg, "num_key_value_heads", where) or heads   # absent or 0: one KV head per query head
    if kv_heads < 1:
        raise MpfaConfigError(f"{where}: num_key_value_heads must be a positive integer, got {kv_heads!r}")
    head_dim = _int_key(cfg, "head_dim", where, positive=True)
    if head_dim is None:
        hidden = _int_key(cfg, "hidden_size", where, positive=True)
        if hidden is None:
            raise MpfaConfigError(f"{where}: has neither head_dim nor hidden_size: add \"head_dim\" (the attention "
                                  "head size) to it")
        head_dim = hidden // heads
    if heads % tp_size:
        raise MpfaConfigError(f"tp-size {tp_size} must divide num_attention_heads {heads} ({where})")
    layer_types = cfg.get("layer_types") or ()
    if not isinstance(layer_types, (list, tuple)) or not all(isinstance(t, str) for t in layer_types):
        raise MpfaConfigError(f"{where}: layer_types must be a list of strings or absent, got {layer_types!r}")
    window = None if cfg.get("sliding_window") is False else _int_key(cfg, "sliding_window", where)   # false: none
    sliding = None
    if window and (cfg.get("use_sliding_window", True) or "sliding_attention" in layer_types):
        sliding = window
    hybrid = None
    if any(t not in ("full_attention", "sliding_attention") for t in layer_types):
        hybrid = f"layer types {sorted(set(layer_types))}"
    elif cfg.get("mamba_d_state") or cfg.get("linear_num_key_heads") or cfg.get("hybrid_override_pattern"):
        hybrid = "Mamba / linear-attention layers"
    return dict(
        head_dim=head_dim, v_head_dim=_int_key(cfg, "v_head_dim", where) or head_dim,
        num_qo_heads=heads // tp_size, num_kv_heads=max(1, kv_heads // tp_size),   # SGLang replicates KV heads
        use_mla=bool(cfg.get("kv_lora_rank")), sliding_window=sliding,
        logit_cap=_number_key(cfg, "attn_logit_softcapping", where),
        is_encoder_decoder=bool(cfg.get("is_encoder_decoder")), hybrid=hybrid)


def check_hf_config(cfg: Mapping, *, page_size: int, recipe: str, tp_size: int = 1,
                    where: str = "config.json") -> dict:
    """:func:`hf_config_facts`, refused through :func:`check_model_supported`; returns the facts."""
    facts = hf_config_facts(cfg, tp_size=tp_size, where=where)
    arch = ",".join(cfg.get("architectures") or ["?"])
    check_model_supported(page_size=page_size, recipe=recipe, what=f"model ({arch})", **facts)
    return facts
