"""Chat data and evaluation prompts where users keep them: the files of a path source
(``files``), rows read from JSON Lines, compressed, JSON arrays, Parquet, saved and hub datasets
(``readers``, ``lines``), layouts turned into chat rows and prompts (``layouts``), mixtures
(``mixture``), hub datasets pinned to a commit (``hub``), and the sources made concrete when the
workflow is planned (``resolve``)."""
