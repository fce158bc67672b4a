"""``python -m src.export ckpt_path=PATH [format=onnx|safetensors]``: a trained model for use outside the project.

onnx: the network with its input normalisation inside; input float RGB images in [0, 1], ``N x 3 x 32 x 32`` for
any N; written by torch.export (``torch.onnx.export(dynamo=True)``). safetensors: the network's weights under
torchvision's names, and beside them a JSON of what a loader needs (docs/export.md). Both are checked against
PyTorch on the test images of the data the run used: the export fails unless they agree (``export.*`` bounds).
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import Any, Iterator

import hydra
from omegaconf import DictConfig, OmegaConf

from src.checkpoints import object_store
from src.cli.entry import data_overrides, handle_errors, run
from src.core import startup
from src.core.errors import UserError, check_number, require, whole

log = logging.getLogger("src.export")
LOWEST_OPSET = 18  # torch's exporter writes 18 and converts down, which fails for a ResNet's layers and leaves 18


def check_export_settings(export_cfg: DictConfig) -> None:
    """The ``export.*`` values, each a one-line UserError before any work: before, a batch size of 0 or an opset of
    ``abc`` ended in a traceback, bounds no file can meet were found out after both exports, an opset below 18 was
    written as 18, and ``validate=maybe`` was taken as true."""
    if not isinstance(export_cfg.validate, bool):
        raise UserError(f"export.validate={export_cfg.validate} must be true or false")
    check_number("export.batch_size", export_cfg.batch_size, whole(1), "a whole number >= 1")
    check_number(
        "export.validation_images",
        export_cfg.validation_images,
        whole(1),
        "a whole number >= 1, or null for every test image",
        optional=True,
    )
    check_number(
        "export.min_top1_agreement",
        export_cfg.min_top1_agreement,
        lambda v: 0 <= v <= 1,
        "in [0, 1]: the share of images on which the file's top class must be PyTorch's",
    )
    check_number(
        "export.max_abs_logit_diff", export_cfg.max_abs_logit_diff, lambda v: v >= 0, "a number >= 0 (0: exact)"
    )
    check_number(
        "export.opset",
        export_cfg.opset,
        whole(LOWEST_OPSET),
        f"a whole number >= {LOWEST_OPSET} (the lowest torch's ONNX exporter writes), or null for its default",
        optional=True,
    )


@hydra.main(version_base="1.3", config_path="../conf", config_name="export")
@handle_errors
def main(cfg: DictConfig) -> dict[str, Any]:
    """Export ``ckpt_path`` in each of ``format``; validate; record the figures in ``export.json``."""
    if OmegaConf.is_missing(cfg, "ckpt_path") or not cfg.ckpt_path:
        raise UserError("ckpt_path=PATH is required: the checkpoint to export (e.g. outputs/.../checkpoints/last.ckpt)")
    check_export_settings(cfg.export)
    import torch  # torch and the model's code load here: not for --help, --cfg or a mistake in the command line

    from src.serving.exporter import (
        PACKAGES,
        RECORD,
        chosen_formats,
        describe,
        export_onnx,
        export_safetensors,
        logits_of,
        validation_images,
        write_record,
    )
    from src.serving.formats import Normalised, data_to_test, load_classifier, run_config_of

    startup.resume()  # loaded: the garbage collector on again (src/core/startup.py)
    formats = chosen_formats(cfg.format)
    for name in formats:
        for package in PACKAGES[name]:
            require(package, "export", f"format={name}")
    given = str(cfg.ckpt_path)
    remote = object_store.is_url(given)  # an s3:// checkpoint: read from its local copy; the files go to export.dir
    path = Path(given.split("://", 1)[-1].rsplit("/", 1)[-1]) if remote else Path(given)  # its name, or the file
    model, checkpoint = load_classifier(given if remote else path, cfg.ckpt_trusted)
    out = Path(cfg.export.dir) if cfg.export.dir else Path.cwd() if remote else path.parent
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserError(f"export.dir={out} cannot be created ({err.strerror}): choose another export.dir") from err
    if not os.access(out, os.W_OK):
        raise UserError(f"{out} is not writable: pass export.dir=DIR for the exported files")
    run_cfg, config_file = run_config_of(given)
    data_cfg, _ = data_to_test(cfg.data, run_cfg, config_file, *data_overrides())
    images, data_name = validation_images(data_cfg, cfg.export) if cfg.export.validate else (None, None)
    net = Normalised(model.net).eval()
    reference = logits_of(net, images, cfg.export.batch_size) if images is not None else None
    meta = describe(model, checkpoint, path, data_cfg, config_file)
    record: dict[str, Any] = {
        "checkpoint": given,
        "validated_on": None if images is None else {"data": data_name, "images": len(images)},
    }
    kept: list[str] = []
    with torch.inference_mode():
        for name in formats:
            target = out / f"{path.stem}.{name}"
            writer = export_onnx if name == "onnx" else export_safetensors
            with refusals_said(target, kept, out):
                record[name] = writer(net, target, meta, images, reference, cfg.export)
            if not record[name].get("failed"):
                kept.append(str(target))
    with refusals_said(out / RECORD, kept, out):
        write_record(out / RECORD, path.name, record)
    failed = [f"{name}: {r['failed']}" for name in formats if (r := record[name]).get("failed")]
    if failed:
        raise UserError(
            f"the export does not match PyTorch ({'; '.join(failed)}; figures in {out / RECORD}): the file was not kept"
        )
    return record


@contextlib.contextmanager
def refusals_said(target: Path, kept: list[str], out: Path) -> Iterator[None]:
    """A write into ``export.dir`` that the filesystem refuses (full, read-only, removed) is one line naming the file
    and what was kept (before: a line about the run dir and its last.ckpt, which an export has neither of)."""
    from src.serving.exporter import refused_write

    try:
        yield
    except Exception as err:
        why = refused_write(err)
        if why is None:
            raise
        raise UserError(
            f"cannot write {target} ({why}): {', '.join(kept) + ' kept' if kept else 'no file kept'}; free space in "
            f"{out}, or pass another export.dir"
        ) from err


if __name__ == "__main__":
    run(main)  # Hydra's own rejections (unknown option, misspelled key) in one line too
