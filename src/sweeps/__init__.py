"""How a sweep runs: jobs skipped when done, each job isolated (sweep), an Optuna search whose trials are runs
(hparams_search), and the scaling report (report)."""
