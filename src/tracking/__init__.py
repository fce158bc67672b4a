"""Where a run's records go: Lightning loggers that continue after a resume (loggers), and the tracking servers
checked before any process starts (servers)."""
