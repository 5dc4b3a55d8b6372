"""A word-level tokenizer over a model's whole vocabulary, for serving runs on dummy weights.

    python -m benchmarks.e2e.synthetic_tokenizer [--model llama-3.1-8b] --out DIR

Id ``i`` is the word ``t<i>``, for every id below the model's ``vocab_size`` (server_configs/models/<model>/
config.json). SGLang's serving client (``sglang.bench_serving``) times text: it starts a request's TTFT at the first
streamed chunk that carries text. A dummy-weight model draws its output ids from its whole vocabulary, so a borrowed
smaller tokenizer (SmolLM2's 49,152 ids against Llama-3.1's 128,256) decodes most of them to nothing, and TTFT would
wait for the first id it knows. Here every id decodes to a word, and the random prompts
(``--dataset-name random-ids``) draw their ids from the model's own range. Written with the standard library alone
(``tokenizer.json`` in the format of Hugging Face ``tokenizers``, and a ``tokenizer_config.json`` naming
``PreTrainedTokenizerFast``), so it needs no download and no package beyond what SGLang brings.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from benchmarks import cli

PROG = "python -m benchmarks.e2e.synthetic_tokenizer"
MODELS_DIR = Path(__file__).resolve().parents[2] / "server_configs" / "models"


def word(i: int) -> str:
    return f"t{i}"


def write(out_dir: Path, vocab_size: int, max_length: int) -> Path:
    """The tokenizer of ``vocab_size`` ids in ``out_dir`` (created); returns ``out_dir``."""
    if vocab_size < 2:
        raise ValueError(f"vocab_size must be at least 2, got {vocab_size}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    spec = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
            "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": None, "decoder": None,
            "model": {"type": "WordLevel", "vocab": {word(i): i for i in range(vocab_size)}, "unk_token": word(0)}}
    (out_dir / "tokenizer.json").write_text(json.dumps(spec))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": word(0), "model_max_length": max_length,
              "clean_up_tokenization_spaces": False}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")
    return out_dir


def write_for_model(model_dir: Path, out_dir: Path) -> Path:
    """The tokenizer of the model whose config.json is in ``model_dir``."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    return write(out_dir, int(cfg["vocab_size"]), int(cfg.get("max_position_embeddings", 131072)))


def main(argv=None) -> int:
    ap = cli.Parser(prog=PROG, description=__doc__.split("\n\n")[0])
    models = sorted(p.name for p in MODELS_DIR.iterdir() if (p / "config.json").exists())
    ap.add_argument("--model", choices=models, default="llama-3.1-8b")
    ap.add_argument("--out", required=True, help="folder to write tokenizer.json and tokenizer_config.json into")
    args = ap.parse_args(argv)
    out = write_for_model(MODELS_DIR / args.model, Path(args.out))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
