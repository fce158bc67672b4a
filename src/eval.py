"""``python -m src.eval ckpt_path=PATH [overrides]``: test loss and accuracy of a checkpoint."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf, open_dict

from src.checkpoints import object_store
from src.cli.entry import data_overrides, handle_errors, run
from src.core import startup
from src.core.errors import UserError
from src.launch.ranks import start_local_ranks
from src.resilience import supervision

log = logging.getLogger("src.eval")


@hydra.main(version_base="1.3", config_path="../conf", config_name="eval")
@handle_errors
def main(cfg: DictConfig) -> dict[str, float]:
    """Evaluate ``ckpt_path`` on the test set; print and save ``test_metrics.json``."""
    if OmegaConf.is_missing(cfg, "ckpt_path") or not cfg.ckpt_path:
        raise UserError(
            "ckpt_path=PATH is required: the checkpoint to evaluate (e.g. outputs/.../checkpoints/last.ckpt)"
        )
    # torch, Lightning and the model's code load here: not for --help, --cfg or a mistake in the command line
    from hydra.utils import instantiate

    from src.checkpoints.files import read_checkpoint
    from src.checkpoints.resume import model_from
    from src.serving.formats import data_to_test, run_config_of
    from src.training.trainer import build_trainer, describe_checkpoint, record_config, test_summary

    startup.resume()  # loaded: the garbage collector on again (src/core/startup.py)
    path = str(cfg.ckpt_path) if object_store.is_url(cfg.ckpt_path) else Path(cfg.ckpt_path)  # a file, or s3://
    checkpoint = read_checkpoint(path, trusted=cfg.ckpt_trusted)
    # every device by default: the test shards count each image once at any world size
    supervision.track(*start_local_ranks(cfg.strategy))
    data, data_name = data_to_test(cfg.data, *run_config_of(cfg.ckpt_path), *data_overrides())
    with open_dict(cfg):
        cfg.data = data  # config.yaml records the data tested
    datamodule = instantiate(cfg.data)
    model = model_from(checkpoint, path)
    trainer = build_trainer(cfg, model.hparams.arch)
    datamodule.prepare_data()
    record_config(cfg, trainer)  # once the data is there, as src.train does
    metrics = {k: float(v) for k, v in trainer.test(model, datamodule=datamodule, verbose=False)[0].items()}
    if trainer.is_global_zero:
        Path(cfg.paths.output_dir, "test_metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
        log.info(
            test_summary(
                metrics,
                f"{describe_checkpoint(path, checkpoint)}, {model.hparams.arch}",
                trainer,
                datamodule,
                data_name,
            )
        )
    return metrics


if __name__ == "__main__":
    run(main)  # Hydra's own rejections (unknown option, misspelled key) in one line too
