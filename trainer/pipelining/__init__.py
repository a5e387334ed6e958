"""Pipeline parallelism: stages, point-to-point transfers, schedules and their op order."""
