"""SGLang end to end: the real small model as an HF folder (smollm2_hf), the backend checks of the
SGLang issue (sglang_check: greedy agreement, KV capacity, CUDA graphs, the launch command)."""
