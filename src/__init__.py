"""cifar10-ddp: ResNet on CIFAR-10 with Lightning + Hydra, from one CPU to many GPU nodes."""

from omegaconf import OmegaConf

from src.launch.ranks import rank_log_suffix, rank_zero_only

# conf/hydra/default.yaml uses these to keep per-process files apart; they must exist before Hydra composes.
OmegaConf.register_new_resolver("rank_log_suffix", rank_log_suffix, replace=True)
OmegaConf.register_new_resolver("rank_zero_only", rank_zero_only, replace=True)
