"""How the processes of a run start, before Lightning loads: which devices a rank uses (devices), which processes
the run has, who starts them and which is rank zero (ranks), what torchrun decides (torchrun), and where they
write: one run per dir (run_dir)."""
