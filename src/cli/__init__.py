"""How a command starts and ends: Hydra's rejections and the task's failures as one line, the checks before any
process starts (entry)."""
