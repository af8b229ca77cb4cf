"""Training the draft: its inputs checked (``inputs``), samples streamed from the shards
(``loader``), one process or DDP under torchrun (``processes``), the draft and teacher built and
the checkpoint written (``build``), an existing draft to start from (``init_from``), the teacher
proven the verifier's own (``teacher_check``), the loop with resume and the best validation kept
(``trainer``), its rows in metrics.jsonl, TensorBoard and W&B (``reporting``), and within a disk
budget the plan of what is kept and what it costs (``disk_budget``) and the engine run beside
training (``stream_consumer``)."""
