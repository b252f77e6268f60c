"""Launching beyond one machine: Slurm jobs for the student, the teacher service and both together,
and the 671B flow of ``launch/run_671b.sh``.

A job is planned first (:func:`~megatron_gkd.launcher.plan.build_plan`: which processes start on which
nodes, in what order, the overrides that point the student at the teacher, the per-device memory of
each layout from :mod:`megatron_gkd.planning`), then run (:class:`~megatron_gkd.launcher.runner.Job`:
``srun`` steps inside Slurm, child processes on one machine). ``--dry-run`` prints the plan and starts
nothing, with no Slurm needed. The command line is ``python -m megatron_gkd.launcher``; the scripts
under ``launch/slurm/`` and ``launch/run_671b.sh`` call it. ``docs/scaling.md`` has the walkthrough.
"""
