"""``python -m src.export ckpt_path=PATH [format=onnx|safetensors]``: a trained model for use outside the project.

onnx: the network with its input normalisation inside; input float RGB images in [0, 1], ``N x 3 x 32 x 32`` for
any N; written by torch.export (``torch.onnx.export(dynamo=True)``). safetensors: the network's weights under
torchvision's names, and beside them a JSON of what a loader needs (docs/export.md). Both are checked against
PyTorch on the test images of the data the run used: the export fails unless they agree (``export.*`` bounds).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

import hydra
import torch
from omegaconf import DictConfig, ListConfig, OmegaConf
from torch import nn

from src.data.in_memory import CIFAR10_MEAN, CIFAR10_STD
from src.entry import handle_errors, overridden_keys, run
from src.errors import UserError, require

log = logging.getLogger("src.export")

FORMATS = ("onnx", "safetensors")
PACKAGES = {"onnx": ("onnx", "onnxscript", "onnxruntime"), "safetensors": ("safetensors",)}
IMAGE_SIZE = 32  # what the CIFAR-style networks here are trained on
RECORD = "export.json"


@hydra.main(version_base="1.3", config_path="../conf", config_name="export")
@handle_errors
def main(cfg: DictConfig) -> dict[str, Any]:
    """Export ``ckpt_path`` in each of ``format``; validate; record the figures in ``export.json``."""
    if OmegaConf.is_missing(cfg, "ckpt_path") or not cfg.ckpt_path:
        raise UserError("ckpt_path=PATH is required: the checkpoint to export (e.g. outputs/.../checkpoints/last.ckpt)")
    formats = chosen_formats(cfg.format)
    for name in formats:
        for package in PACKAGES[name]:
            require(package, "export", f"format={name}")
    path = Path(cfg.ckpt_path)
    model, checkpoint = load_classifier(path, cfg.ckpt_trusted)
    out = Path(cfg.export.dir) if cfg.export.dir else path.parent
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserError(f"export.dir={out} cannot be created ({err.strerror}): choose another export.dir") from err
    if not os.access(out, os.W_OK):
        raise UserError(f"{out} is not writable: pass export.dir=DIR for the exported files")
    run_cfg, config_file = run_config(path)
    data_cfg = cfg.data if run_cfg is None or "data" in {k.split(".")[0] for k in overridden_keys()} else run_cfg.data
    images, data_name = validation_images(data_cfg, cfg.export) if cfg.export.validate else (None, None)
    net = Normalised(model.net).eval()
    reference = logits_of(net, images, cfg.export.batch_size) if images is not None else None
    meta = describe(model, checkpoint, path, data_cfg, config_file)
    record: dict[str, Any] = {"checkpoint": str(path), "validated_on": None if images is None else
                              {"data": data_name, "images": len(images)}}
    with torch.inference_mode():
        for name in formats:
            target = out / f"{path.stem}.{name}"
            writer = export_onnx if name == "onnx" else export_safetensors
            record[name] = writer(net, target, meta, images, reference, cfg.export)
    write_record(out / RECORD, path.name, record)
    failed = [f"{name}: {r['failed']}" for name in formats if (r := record[name]).get("failed")]
    if failed:
        raise UserError(f"the export does not match PyTorch ({'; '.join(failed)}; figures in {out / RECORD}): "
                        "the file was not kept")
    return record


def chosen_formats(value: Any) -> list[str]:
    """``format=onnx``, ``format=[onnx,safetensors]`` or ``format=onnx,safetensors`` as a list; unknown ones refused."""
    names = list(value) if isinstance(value, (list, tuple, ListConfig)) else str(value).split(",")
    names = [str(n).strip() for n in names if str(n).strip()]
    unknown = [n for n in names if n not in FORMATS]
    if unknown or not names:
        raise UserError(f"format={','.join(names) or value} is not known: choose one or more of {', '.join(FORMATS)} "
                        "(format=[onnx,safetensors] for both)")
    return list(dict.fromkeys(names))


def load_classifier(path: Path, trusted: bool):  # noqa: ANN201 - (ImageClassifier, the checkpoint)
    """The project's model from a checkpoint, in eval mode, read weights-only unless ``trusted`` (src/checkpoints.py)."""
    from src.checkpoints import model_from, read_checkpoint

    checkpoint = read_checkpoint(path, trusted=trusted)
    return model_from(checkpoint, path).eval(), checkpoint


def run_config(ckpt_path: Path) -> tuple[DictConfig | None, Path | None]:
    """The resolved config src.train saved in the run dir that holds ``ckpt_path`` (RUN/checkpoints/x.ckpt)."""
    for folder in (ckpt_path.parent.parent, ckpt_path.parent):
        candidate = folder / "config.yaml"
        if candidate.is_file():
            try:
                loaded = OmegaConf.load(candidate)
            except Exception:  # noqa: BLE001 - not a config of ours: as if there were none
                continue
            if isinstance(loaded, DictConfig) and _plain_data(loaded.get("data")):
                return loaded, candidate
            log.warning("%s: its data is not one of this project's datamodules with plain values; not used",
                        candidate)
    return None, None


DATAMODULES = ("src.data.cifar10.CIFAR10DataModule", "src.data.synthetic.SyntheticDataModule")


def _plain_data(data: Any) -> bool:
    """Whether a config file's ``data`` builds one of the project's datamodules from plain values: a file beside a
    checkpoint is as untrusted as the checkpoint, and ``instantiate`` would import whatever ``_target_`` names."""
    return (isinstance(data, DictConfig) and data.get("_target_") in DATAMODULES
            and all(isinstance(v, (str, int, float, bool)) or v is None for v in data.values()))


def class_names(data_cfg: DictConfig | None, num_classes: int) -> list[str]:
    """The names of the classes the data's labels stand for (``class 3`` where the data has none)."""
    if data_cfg is not None:
        from hydra.utils import instantiate

        try:
            names = list(instantiate(data_cfg).class_names)
        except Exception:  # noqa: BLE001 - names are a courtesy: a data config that no longer builds has none
            names = []
        if len(names) == num_classes:
            return names
    return [f"class {i}" for i in range(num_classes)]


def validation_images(data_cfg: DictConfig, export_cfg: DictConfig):  # noqa: ANN201 - (float tensor, data name)
    """The data's test images as floats in [0, 1] (the first ``export.validation_images`` of them, if set)."""
    from hydra.utils import instantiate

    datamodule = instantiate(data_cfg)
    datamodule.prepare_data()
    datamodule.setup("test")
    images = datamodule.test_set.images
    limit = export_cfg.validation_images
    if limit is not None:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise UserError(f"export.validation_images={limit} must be a whole number >= 1, or null for every test "
                            "image")
        images = images[:limit]
    if tuple(images.shape[1:]) != (3, IMAGE_SIZE, IMAGE_SIZE):
        raise UserError(f"the test images of {data_cfg._target_} are {tuple(images.shape[1:])}, not 3x32x32: the "
                        "exported model takes 32x32 RGB images; validate on CIFAR-style data")
    name = data_cfg._target_.rsplit(".", 1)[-1]
    root = data_cfg.get("root")
    return images.to(torch.float32) / 255, f"{name} ({root})" if root else name


class Normalised(nn.Module):
    """``net`` preceded by the training normalisation: input float RGB images in [0, 1]."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net
        self.register_buffer("mean", torch.tensor(CIFAR10_MEAN).view(1, 3, 1, 1))
        self.register_buffer("std", torch.tensor(CIFAR10_STD).view(1, 3, 1, 1))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.net((images - self.mean) / self.std)


def logits_of(model: Any, images: torch.Tensor, batch_size: int) -> torch.Tensor:
    """``model``'s fp32 logits for ``images``, a batch at a time (a callable of a batch, or a module)."""
    with torch.inference_mode():
        return torch.cat([torch.as_tensor(model(images[i:i + batch_size])) for i in range(0, len(images), batch_size)])


def agreement(reference: Any, logits: Any, export_cfg: DictConfig) -> dict[str, Any]:
    """Top-1 agreement and the largest absolute logit difference; ``failed`` says which bound is missed."""
    top1 = float((reference.argmax(1) == logits.argmax(1)).double().mean())
    diff = float((reference - logits).abs().max())
    figures: dict[str, Any] = {"top1_agreement": top1, "max_abs_logit_diff": diff,
                               "bounds": {"min_top1_agreement": export_cfg.min_top1_agreement,
                                          "max_abs_logit_diff": export_cfg.max_abs_logit_diff}}
    misses = []
    if top1 < export_cfg.min_top1_agreement:
        misses.append(f"top-1 agrees on {top1:.2%} of images, below export.min_top1_agreement="
                      f"{export_cfg.min_top1_agreement}")
    if not diff <= export_cfg.max_abs_logit_diff:  # NaN too
        misses.append(f"logits differ by up to {diff:.3g}, above export.max_abs_logit_diff="
                      f"{export_cfg.max_abs_logit_diff}")
    if misses:
        figures["failed"] = "; ".join(misses)
    return figures


def export_onnx(net: Any, target: Path, meta: dict[str, Any], images: Any, reference: Any,
                export_cfg: DictConfig) -> dict[str, Any]:
    """Write ``target`` (fp32, dynamic batch) via torch.export; check it with onnxruntime on ``images``."""
    import onnx

    for name in ("onnxscript", "onnx_ir"):  # each optimisation pass says what it did, at INFO
        logging.getLogger(name).setLevel(logging.WARNING)
    staged = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    batch = torch.export.Dim("batch", min=1, max=1 << 20)
    try:
        program = torch.onnx.export(net, (torch.rand(2, 3, IMAGE_SIZE, IMAGE_SIZE),), dynamo=True,
                                    input_names=["images"], output_names=["logits"], opset_version=export_cfg.opset,
                                    dynamic_shapes={"images": {0: batch}}, external_data=False, verbose=False)
        model = program.model_proto
        described = {**meta, "input": "float32 RGB images in [0, 1], N x 3 x 32 x 32 (normalised inside)"}
        for key, value in described.items():
            model.metadata_props.add(key=key, value=value if isinstance(value, str) else json.dumps(value))
        onnx.save(model, staged)
        figures: dict[str, Any] = {"file": str(target), "opset": model.opset_import[0].version}
        if images is not None:
            session = onnx_session(staged)
            figures.update(agreement(reference, logits_of(lambda x: session.run(None, {"images": x.numpy()})[0],
                                                          images, export_cfg.batch_size), export_cfg))
            log.info("onnx: onnxruntime %s vs PyTorch on %d images: top-1 agreement %.4f, max |logit diff| %.2e",
                     _version("onnxruntime"), len(images), figures["top1_agreement"], figures["max_abs_logit_diff"])
        if "failed" not in figures:
            os.replace(staged, target)
            log.info("onnx: %s", target)
        return figures
    finally:
        staged.unlink(missing_ok=True)


def onnx_session(path: Path) -> Any:
    """An onnxruntime session on the CPU, quiet."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3  # errors only
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def export_safetensors(net: Any, target: Path, meta: dict[str, Any], images: Any, reference: Any,
                       export_cfg: DictConfig) -> dict[str, Any]:
    """Write the weights (torchvision's names) and ``<stem>.json``; check that torchvision rebuilt from them agrees."""
    from safetensors.torch import save_file

    staged = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    described = target.with_suffix(".json")
    weights = {k: v.detach().contiguous() for k, v in net.net.state_dict().items()}
    try:
        save_file(weights, staged, metadata={"format": "pt", "arch": meta["arch"], "stem": meta["stem"],
                                             "num_classes": str(meta["num_classes"])})
        figures: dict[str, Any] = {"file": str(target), "json": str(described)}
        if images is not None:
            rebuilt = Normalised(torchvision_network(meta, staged))
            figures.update(agreement(reference, logits_of(rebuilt.eval(), images, export_cfg.batch_size), export_cfg))
            log.info("safetensors: torchvision rebuilt from it vs the checkpoint on %d images: top-1 agreement %.4f, "
                     "max |logit diff| %.2e", len(images), figures["top1_agreement"], figures["max_abs_logit_diff"])
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


def torchvision_network(meta: dict[str, Any], weights: Path) -> Any:
    """The loader docs/export.md shows: torchvision's network, the CIFAR stem where ``meta`` says, the weights."""
    import torchvision
    from safetensors.torch import load_file

    net = torchvision.models.get_model(meta["arch"], num_classes=meta["num_classes"])
    if meta["stem"] == "cifar":
        net.conv1, net.maxpool = torch.nn.Conv2d(3, 64, 3, 1, 1, bias=False), torch.nn.Identity()
    net.load_state_dict(load_file(weights))
    return net.eval()


def describe(model: Any, checkpoint: dict[str, Any], path: Path, data_cfg: DictConfig | None,
             config_file: Path | None) -> dict[str, Any]:
    """What a loader needs beside the weights, and where they came from."""
    hp = model.hparams
    return {
        "arch": hp.arch, "stem": hp.stem, "num_classes": hp.num_classes,
        "class_names": class_names(data_cfg, hp.num_classes),
        "input": {"shape": ["N", 3, IMAGE_SIZE, IMAGE_SIZE], "range": [0.0, 1.0], "channels": "RGB"},
        "mean": list(CIFAR10_MEAN), "std": list(CIFAR10_STD),
        "checkpoint": {"file": path.name, "epoch": checkpoint.get("epoch"), "step": checkpoint.get("global_step"),
                       "val_acc": val_accuracy(checkpoint)},
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
    from src.run_dir import read_json, write_json

    write_json(path, {**(read_json(path) or {}), name: record})


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


if __name__ == "__main__":
    run(main)  # Hydra's own rejections (unknown option, misspelled key) in one line too
