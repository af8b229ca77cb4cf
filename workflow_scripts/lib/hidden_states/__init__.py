"""The verifier's hidden states on disk: the shard format and reader (``shards``; its version and
layer convention, ``shard_format``), streaming writes (``shard_writer``), the typed records of
parts, manifest and stream plan (``records``), the manifest's merge with every shard's checksum
(``manifest``), what the engines compute (``shard_plan``: each shard's samples, metadata, bytes and
key), extraction's plan and reuse of finished shards (``extraction``), the disk plan (``disk_plan``) and the dry-run's estimate of it
from prepare's counts (``estimate``), the engines (``extract_engines``: vLLM through the KV
``connector``; ``transformers_backend``), the positions recorded for the teacher check
(``teacher_record``) and, within a disk budget, the engine's run in training's order
(``stream_producer``)."""
