"""cifar10-ddp: ResNet on CIFAR-10 with Lightning + Hydra, from one CPU to many GPU nodes."""

from src.core import startup, user_folders

startup.pause()  # python -m src.train (eval, export, predict): the garbage collector off while they load
user_folders.matplotlib_folder()  # before torchmetrics imports matplotlib: a folder of its own where home is read-only

from omegaconf import OmegaConf  # noqa: E402

from src.cli.help import config_groups  # noqa: E402
from src.launch.ranks import rank_log_suffix, rank_zero_only  # noqa: E402
from src.launch.run_dir import output_dir  # noqa: E402

# conf/hydra/default.yaml uses these to keep per-process files apart; they must exist before Hydra composes.
OmegaConf.register_new_resolver("rank_log_suffix", rank_log_suffix, replace=True)
OmegaConf.register_new_resolver("rank_zero_only", rank_zero_only, replace=True)
OmegaConf.register_new_resolver("config_groups", config_groups, replace=True)  # its --help page
OmegaConf.register_new_resolver("output_dir", output_dir, replace=True)  # paths.output_dir, --cfg job's too
