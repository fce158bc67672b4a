"""Writing ONNX and safetensors, and checking them against PyTorch: a file is kept only if it agrees.

onnx: the network with its input normalisation inside, written by torch.export (``torch.onnx.export(dynamo=True)``);
safetensors: the network's weights under torchvision's names, and beside them a JSON of what a loader needs
(docs/export.md). Both are checked on the test images of the data the run used (``export.*`` bounds), and the
figures go to ``export.json``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, ListConfig, OmegaConf

from src.core.errors import UserError, storage_error_in
from src.data.in_memory import CIFAR10_MEAN, CIFAR10_STD
from src.serving.formats import IMAGE_SIZE, Normalised, class_names, onnx_session, torchvision_network

log = logging.getLogger(__name__)


FORMATS = ("onnx", "safetensors")


PACKAGES = {"onnx": ("onnx", "onnxscript", "onnxruntime"), "safetensors": ("safetensors",)}


RECORD = "export.json"


def refused_write(err: BaseException) -> str | None:
    """Why the filesystem refused one of the export's writes (full, read-only, removed), or None for another error:
    an OSError, or safetensors' own error, which carries the OS's words in its text only."""
    found = storage_error_in(err)
    if found is not None:
        return found.strerror or str(found)
    words = re.search(r"I/O error: (.+?) \(os error \d+\)", str(err))
    return words.group(1) if words else None


def chosen_formats(value: Any) -> list[str]:
    """``format=onnx``, ``format=[onnx,safetensors]`` or ``format=onnx,safetensors`` as a list; unknown ones refused."""
    names = list(value) if isinstance(value, (list, tuple, ListConfig)) else str(value).split(",")
    names = [str(n).strip() for n in names if str(n).strip()]
    unknown = [n for n in names if n not in FORMATS]
    if unknown or not names:
        raise UserError(
            f"format={','.join(names) or value} is not known: choose one or more of {', '.join(FORMATS)} "
            "(format=[onnx,safetensors] for both)"
        )
    return list(dict.fromkeys(names))


def validation_images(data_cfg: DictConfig, export_cfg: DictConfig):  # noqa: ANN201 - (float tensor, data name)
    """The data's test images as floats in [0, 1] (the first ``export.validation_images`` of them, if set)."""
    from hydra.utils import instantiate

    datamodule = instantiate(data_cfg)
    datamodule.prepare_data()
    datamodule.setup("test")
    images = datamodule.test_set.images
    if export_cfg.validation_images is not None:  # a whole number >= 1 (src/export.py's check_export_settings)
        images = images[: export_cfg.validation_images]
    if tuple(images.shape[1:]) != (3, IMAGE_SIZE, IMAGE_SIZE):
        raise UserError(
            f"the test images of {data_cfg._target_} are {tuple(images.shape[1:])}, not 3x32x32: the "
            "exported model takes 32x32 RGB images; validate on CIFAR-style data"
        )
    name = data_cfg._target_.rsplit(".", 1)[-1]
    root = data_cfg.get("root")
    return images.to(torch.float32) / 255, f"{name} ({root})" if root else name


def logits_of(model: Any, images: torch.Tensor, batch_size: int) -> torch.Tensor:
    """``model``'s fp32 logits for ``images``, a batch at a time (a callable of a batch, or a module)."""
    with torch.inference_mode():
        return torch.cat(
            [torch.as_tensor(model(images[i : i + batch_size])) for i in range(0, len(images), batch_size)]
        )


def agreement(reference: Any, logits: Any, export_cfg: DictConfig) -> dict[str, Any]:
    """Top-1 agreement and the largest absolute logit difference; ``failed`` says which bound is missed."""
    top1 = float((reference.argmax(1) == logits.argmax(1)).double().mean())
    diff = float((reference - logits).abs().max())
    figures: dict[str, Any] = {
        "top1_agreement": top1,
        "max_abs_logit_diff": diff,
        "bounds": {
            "min_top1_agreement": export_cfg.min_top1_agreement,
            "max_abs_logit_diff": export_cfg.max_abs_logit_diff,
        },
    }
    misses = []
    if top1 < export_cfg.min_top1_agreement:
        misses.append(
            f"top-1 agrees on {top1:.2%} of images, below export.min_top1_agreement={export_cfg.min_top1_agreement}"
        )
    if not diff <= export_cfg.max_abs_logit_diff:  # NaN too
        misses.append(
            f"logits differ by up to {diff:.3g}, above export.max_abs_logit_diff={export_cfg.max_abs_logit_diff}"
        )
    if misses:
        figures["failed"] = "; ".join(misses)
    return figures


def export_onnx(
    net: Any, target: Path, meta: dict[str, Any], images: Any, reference: Any, export_cfg: DictConfig
) -> dict[str, Any]:
    """Write ``target`` (fp32, dynamic batch) via torch.export; check it with onnxruntime on ``images``."""
    import onnx

    for name in ("onnxscript", "onnx_ir"):  # each optimisation pass says what it did, at INFO
        logging.getLogger(name).setLevel(logging.WARNING)
    staged = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    batch = torch.export.Dim("batch", min=1, max=1 << 20)
    opset = export_cfg.opset
    if opset is not None and opset > onnx.defs.onnx_opset_version():
        raise UserError(
            f"export.opset={opset} is newer than onnx {_version('onnx')} knows (up to "
            f"{onnx.defs.onnx_opset_version()}): pass a lower export.opset, or null for the exporter's default"
        )
    try:
        try:
            program = torch.onnx.export(
                net,
                (torch.rand(2, 3, IMAGE_SIZE, IMAGE_SIZE),),
                dynamo=True,
                input_names=["images"],
                output_names=["logits"],
                opset_version=opset,
                dynamic_shapes={"images": {0: batch}},
                external_data=False,
                verbose=False,
            )
        except Exception as err:  # noqa: BLE001 - at the default opset a failure is the exporter's: raised as it is
            if opset is None:
                raise
            first = re.sub(r"\x1b\[[0-9;]*m", "", str(err)).strip().split("\n", 1)[0]  # torch colours its words
            raise UserError(
                f"torch's ONNX exporter failed at export.opset={opset} ({type(err).__name__}: {first}): pass another "
                "export.opset, or null for its default"
            ) from err
        model = program.model_proto
        written = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
        if opset is not None and written != opset:  # the version converter fell back to the exporter's own
            raise UserError(
                f"torch's ONNX exporter wrote opset {written}, not export.opset={opset}: pass export.opset={written} "
                "or null for its default"
            )
        described = {**meta, "input": "float32 RGB images in [0, 1], N x 3 x 32 x 32 (normalised inside)"}
        for key, value in described.items():
            model.metadata_props.add(key=key, value=value if isinstance(value, str) else json.dumps(value))
        onnx.save(model, staged)
        figures: dict[str, Any] = {"file": str(target), "opset": written}
        if images is not None:
            session = onnx_session(staged)
            figures.update(
                agreement(
                    reference,
                    logits_of(lambda x: session.run(None, {"images": x.numpy()})[0], images, export_cfg.batch_size),
                    export_cfg,
                )
            )
            log.info(
                "onnx: onnxruntime %s vs PyTorch on %d images: top-1 agreement %.4f, max |logit diff| %.2e",
                _version("onnxruntime"),
                len(images),
                figures["top1_agreement"],
                figures["max_abs_logit_diff"],
            )
        if "failed" not in figures:
            os.replace(staged, target)
            log.info("onnx: %s", target)
        return figures
    finally:
        staged.unlink(missing_ok=True)


def export_safetensors(
    net: Any, target: Path, meta: dict[str, Any], images: Any, reference: Any, export_cfg: DictConfig
) -> dict[str, Any]:
    """Write the weights (torchvision's names) and ``<stem>.json``; check that torchvision rebuilt from them agrees."""
    from safetensors.torch import save_file

    from src.models.resnet import WIDTH

    staged = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    described = target.with_suffix(".json")
    weights = {k: v.detach().contiguous() for k, v in net.net.state_dict().items()}
    try:
        save_file(
            weights,
            staged,
            metadata={
                "format": "pt",
                "arch": meta["arch"],
                "stem": meta["stem"],
                "width": str(meta.get("width", WIDTH)),
                "num_classes": str(meta["num_classes"]),
            },
        )
        figures: dict[str, Any] = {"file": str(target), "json": str(described)}
        if images is not None:
            rebuilt = Normalised(torchvision_network(meta, staged))
            figures.update(agreement(reference, logits_of(rebuilt.eval(), images, export_cfg.batch_size), export_cfg))
            log.info(
                "safetensors: torchvision rebuilt from it vs the checkpoint on %d images: top-1 agreement %.4f, "
                "max |logit diff| %.2e",
                len(images),
                figures["top1_agreement"],
                figures["max_abs_logit_diff"],
            )
        if "failed" not in figures:
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(staged, 0o666 & ~umask)  # safetensors writes owner-only; a model is for others to read
            os.replace(staged, target)
            described.write_text(json.dumps(meta, indent=2) + "\n")
            log.info("safetensors: %s and %s", target, described)
        return figures
    finally:
        staged.unlink(missing_ok=True)


def describe(
    model: Any, checkpoint: dict[str, Any], path: Path, data_cfg: DictConfig | None, config_file: Path | None
) -> dict[str, Any]:
    """What a loader needs beside the weights, and where they came from."""
    hp = model.hparams
    return {
        "arch": hp.arch,
        "stem": hp.stem,
        "width": hp.width,
        "num_classes": hp.num_classes,
        "class_names": class_names(data_cfg, hp.num_classes),
        "input": {"shape": ["N", 3, IMAGE_SIZE, IMAGE_SIZE], "range": [0.0, 1.0], "channels": "RGB"},
        "mean": list(CIFAR10_MEAN),
        "std": list(CIFAR10_STD),
        "checkpoint": {
            "file": path.name,
            "epoch": checkpoint.get("epoch"),
            "step": checkpoint.get("global_step"),
            "val_acc": val_accuracy(checkpoint),
        },
        "config_sha256": config_digest(config_file, checkpoint),
    }


def val_accuracy(checkpoint: dict[str, Any]) -> float | None:
    """val/acc when the checkpoint was written, as its ModelCheckpoint state recorded it."""
    for key, state in (checkpoint.get("callbacks") or {}).items():
        if str(key).startswith("ModelCheckpoint") and isinstance(state, dict) and state.get("monitor") == "val/acc":
            score = state.get("current_score")
            return None if score is None else round(float(score), 6)
    return None


def config_digest(config_file: Path | None, checkpoint: dict[str, Any]) -> str:
    """SHA-256 of the run's resolved config (config.yaml beside the checkpoints), else of its hyperparameters."""
    if config_file is not None:
        resolved = OmegaConf.to_container(OmegaConf.load(config_file), resolve=True)
    else:
        resolved = checkpoint.get("hyper_parameters") or {}
    return hashlib.sha256(json.dumps(resolved, sort_keys=True, default=str).encode()).hexdigest()


def write_record(path: Path, name: str, record: dict[str, Any]) -> None:
    """Add this checkpoint's entry to ``export.json`` (one entry per checkpoint exported into the folder)."""
    from src.launch.run_dir import read_json, write_json

    write_json(path, {**(read_json(path) or {}), name: record})


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)
