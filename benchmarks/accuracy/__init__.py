"""Accuracy of the recipes (issue 7): kernel-level output error against fp64 exact attention, and
model-level perplexity / KL / needle retrieval with SmolLM2-135M whose attention runs through mpfa.

    python -m benchmarks.accuracy.run [--quick] [--device cuda|cpu] [--lengths ...] [--publish]

writes ``accuracy.json`` ({"meta", "summary", "rows"}) and ``accuracy.png`` to benchmarks/results/scratch,
or with ``--publish`` (a cuda run without errors on the GPU the published file names) to benchmarks/results.
Modules: :mod:`.metrics` (error and perplexity arithmetic), :mod:`.kernel` (cache path + prefill /
decode wrappers vs fp64), :mod:`.model` (the transformers attention swap, perplexity, KL, needle),
:mod:`.data` (KJV and stdlib text, fetched at run time, never committed), :mod:`.summary`
(``summarize(rows)``). docs/accuracy.md explains every metric.
"""


def summarize(rows: list[dict]) -> dict:
    """The summary of a results file, computed only from its rows (see :mod:`.summary`)."""
    from .summary import summarize as _summarize
    return _summarize(rows)

__all__ = ["summarize"]
