"""What Trainer a run gets: its strategy, callbacks, loggers, plugins and precision for the hardware found."""
