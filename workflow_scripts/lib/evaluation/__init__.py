"""Evaluation: acceptance length under vLLM speculative decoding, against n-gram speculation on
the same prompts (``acceptance``), and its plots (``plots``)."""
