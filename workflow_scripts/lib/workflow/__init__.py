"""The workflow's contracts and plumbing: every stage's typed settings (``definitions``,
``train_params``, on ``params_base``), config.yaml's model and JSON schema (``config``), the stage
registry (``registry``), command lines and the scripts' parsers (``cli``), the code a stage runs
(``code_inputs``) and GPU leases for local jobs (``gpus``). Imports nothing else of the library."""
