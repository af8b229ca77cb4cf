"""`snakemake` for the test cluster, its SLURM plugin checking the jobs' status every POLL_S.

The plugin (2.6.1) waits 10 s longer before each status check while none of its jobs finished
(up to 180 s), and once more after a run's last job failed before Snakemake exits: on a real
cluster of hour-long jobs that spares slurmctld; on this one, whose jobs take a minute, it added
half a minute to each job and about a minute to each run that fails on purpose. Everything
else is Snakemake's own command line: tests/test_slurm.py runs `python poll_often.py ARGS` where
a user runs `snakemake ARGS`.
"""

import sys

from snakemake.cli import main
from snakemake_executor_plugin_slurm import Executor

POLL_S = 2

_check_active_jobs = Executor.check_active_jobs


async def check_active_jobs(self, active_jobs):
    async for job in _check_active_jobs(self, active_jobs):
        yield job
    self.next_seconds_between_status_checks = min(self.next_seconds_between_status_checks, POLL_S)


Executor.check_active_jobs = check_active_jobs

if __name__ == "__main__":
    sys.exit(main())
