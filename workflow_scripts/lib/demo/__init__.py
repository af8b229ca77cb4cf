"""The embedded default, built offline: chat data (``conversations``: rule-based; ``agentic``:
with reasoning and tool calls; ``docs``: natural text from package docstrings), the demo
verifiers' chat formats (``formats``) and the tiny verifier with its tokenizer (``verifier``)."""
