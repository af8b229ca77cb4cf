"""Regeneration (self-distillation): the verifier answers the data's user turns itself
(``answers``: batches on disk, resumable), one job's loop (``run``), the records its jobs hand the
merge (``records``), and the jobs' parts merged (``merge``)."""
