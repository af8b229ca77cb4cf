"""The workflow's contracts and plumbing: every stage's typed settings (``definitions``,
``train_params``, on ``params_base``), config.yaml's model, JSON schema and refusals
(``config``), the dry-run's checks of the config alone (``checks``), the data sources' settings
(``sources``), the stage registry (``registry``), the paths under results_dir (``layout``), the
records' base and the summaries the dry-run reads (``records``), a stage's data-parallel jobs
(``jobs``), command lines and the scripts' parsers (``cli``), the code a stage runs and the keys
of what it resumes (``code_inputs``), GPU leases for local jobs (``gpus``) and the launcher of a
job over several nodes (``nodes``). Imports only ``common`` of the library."""
