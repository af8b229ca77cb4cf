"""The embedded default, built offline (``build``: the stage's work and the corpus it names):
chat data (``conversations``: rule-based; ``agentic``: with reasoning and tool calls; ``docs``:
natural text from package docstrings; ``long_docs``: long documents for long contexts), the demo
verifiers' chat formats (``formats``) and the tiny verifier with its tokenizer (``verifier``); a
real pretrained verifier from an installed package (``smollm2``) and human-written prompts from
the evals registry (``evals_corpus``)."""
