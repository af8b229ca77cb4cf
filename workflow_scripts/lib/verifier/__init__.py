"""The verifier: its files on disk (``files``: config, weights, tokenizer, identity, the tensors
the draft takes), its vLLM engine (``engine``), over several nodes (``engine_nodes``: node 0's
arguments; ``engine_follower``: the other nodes' workers), what it takes of an engine's memory
(``memory``: its KV cache and weights against the settings and the GPUs), what the installed vLLM
can do with its architecture (``vllm_support``), the environment the jobs run in
(``environment``), the jobs over several nodes against the cluster (``cluster``), and the checks
of the settings against it and this machine, at dry-run and in each job (``preflight``)."""
