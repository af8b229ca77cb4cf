"""`snakemake` for the test cluster, its SLURM plugin checking the jobs' status every POLL_S and
submitting them without pausing first.

The plugin (2.6.1) waits 10 s longer before each status check while none of its jobs finished
(up to 180 s), and once more after a run's last job failed before Snakemake exits; and it sleeps
5 s before every `sbatch`. On a real cluster of hour-long jobs that spares slurmctld; on this
one, whose jobs take a minute, the waits added half a minute to each job and about a minute to
each run that fails on purpose. Everything else is Snakemake's own command line:
tests/test_slurm.py runs `python poll_often.py ARGS` where a user runs `snakemake ARGS`.
"""

import sys
import time

import snakemake_executor_plugin_slurm as plugin
from snakemake.cli import main

POLL_S = 2

_check_active_jobs = plugin.Executor.check_active_jobs


async def check_active_jobs(self, active_jobs):
    async for job in _check_active_jobs(self, active_jobs):
        yield job
    self.next_seconds_between_status_checks = min(self.next_seconds_between_status_checks, POLL_S)


class NoPause:
    """The `time` module as the plugin sees it, whose `sleep` (its pause before each `sbatch`,
    the only sleep it takes outside a SLURM job) returns at once."""

    def __getattr__(self, name):
        return getattr(time, name)

    @staticmethod
    def sleep(seconds: float) -> None:
        pass


plugin.Executor.check_active_jobs = check_active_jobs
plugin.time = NoPause()

if __name__ == "__main__":
    sys.exit(main())
