"""Evaluation: acceptance length under vLLM speculative decoding, against n-gram speculation on
the same prompts (``acceptance``: the engines, their counters, the intervals), the stage's work
(``run``), serving speed at each concurrency (``speed``), what it writes (``records``), and its
plots (``plots``)."""
