"""Chat data: rows as users bring them (``rows``), the verifier's chat template as it is served
(``template``), each assistant turn supervised exactly as generated and packed into the fewest
rows (``turns``), and whole files tokenized for training (``tokenization``)."""
