"""Server configs (server_configs/*.yaml): SGLang launch arguments plus an ``mpfa:`` section.

    model: models/llama-3.1-8b        # a folder with config.json, relative to the YAML file
    sglang: {load-format: dummy, page-size: 16, tp-size: 1, ...}
    mpfa: {recipe: qk4pv8, compensation: true, page_size: 16}

The warmup command and the benchmarks read the model's attention shape from config.json.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import yaml

RECIPES = ("bf16", "qk8pv8", "qk4pv8")


@dataclass(frozen=True)
class AttentionShape:
    num_qo_heads: int       # per GPU (after tensor parallelism)
    num_kv_heads: int       # per GPU
    head_dim: int
    num_layers: int


@dataclass(frozen=True)
class ServerConfig:
    path: Path
    model_dir: Path
    sglang: dict
    recipe: str
    compensation: bool
    page_size: int
    shape: AttentionShape


def model_shape(model_dir: Path, tp_size: int = 1) -> AttentionShape:
    cfg_path = Path(model_dir) / "config.json"
    try:
        cfg = json.loads(cfg_path.read_text())
    except FileNotFoundError:
        raise ValueError(f"model directory {model_dir} has no config.json") from None
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads", heads)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    if heads % tp_size:
        raise ValueError(f"tp-size {tp_size} must divide num_attention_heads {heads}")
    # SGLang replicates KV heads when tp_size exceeds them.
    return AttentionShape(heads // tp_size, max(1, kv_heads // tp_size), head_dim, cfg["num_hidden_layers"])


def load(path: "str | Path") -> ServerConfig:
    path = Path(path)
    data = yaml.safe_load(path.read_text()) or {}
    if "model" not in data:
        raise ValueError(f"{path}: missing 'model' (a folder with config.json, relative to the config)")
    model_dir = (path.parent / data["model"]).resolve()
    sglang = dict(data.get("sglang") or {})
    m = dict(data.get("mpfa") or {})
    recipe = m.get("recipe", "qk4pv8")
    if recipe not in RECIPES:
        raise ValueError(f"{path}: mpfa.recipe must be one of {list(RECIPES)}, got {recipe!r}")
    page_size = int(m.get("page_size", sglang.get("page-size", 16)))
    if "page-size" in sglang and int(sglang["page-size"]) != page_size:
        raise ValueError(f"{path}: mpfa.page_size {page_size} differs from sglang page-size {sglang['page-size']}")
    shape = model_shape(model_dir, int(sglang.get("tp-size", 1)))
    return ServerConfig(path, model_dir, sglang, recipe, bool(m.get("compensation", True)), page_size, shape)
