"""Regeneration (self-distillation): the verifier answers the data's user turns itself
(``answers``: batches on disk, resumable) and the jobs' parts are merged (``merge``)."""
