"""Callbacks Lightning lacks: run summary, throughput record, sync-free progress bar, SIGTERM stop, Slurm requeue."""
