"""cifar10-ddp: ResNet on CIFAR-10 with Lightning + Hydra, from one CPU to many GPU nodes."""

from omegaconf import OmegaConf

from src.distributed import rank_log_suffix

# conf/hydra/default.yaml names each process's log file with this; it must exist before Hydra composes.
OmegaConf.register_new_resolver("rank_log_suffix", rank_log_suffix, replace=True)
