"""A trained model in each of its formats, and what every side shares.

The formats: a checkpoint of src.train, and the ONNX and safetensors files src.export writes from it. The invariant
every format keeps: it takes float RGB images in [0, 1], ``N x 3 x 32 x 32``, and gives logits, with the input
normalisation inside the network (``Normalised``); the class names come from the run's own data config.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Callable

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from src.checkpoints import object_store
from src.core.errors import UserError, require
from src.data.in_memory import CIFAR10_MEAN, CIFAR10_STD

log = logging.getLogger(__name__)


IMAGE_SIZE = 32  # what the CIFAR-style networks here are trained on


def load_classifier(path: str | Path, trusted: bool):  # noqa: ANN201 - (ImageClassifier, the checkpoint)
    """The project's model from a checkpoint, in eval mode, read weights-only unless ``trusted`` (src/checkpoints/)."""
    from src.checkpoints.files import read_checkpoint
    from src.checkpoints.resume import model_from

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
            log.warning("%s: its data is not one of this project's datamodules with plain values; not used", candidate)
    return None, None


DATAMODULES = {"src.data.cifar10.CIFAR10DataModule": "cifar10", "src.data.synthetic.SyntheticDataModule": "synthetic"}


def run_config_of(ckpt_path: str | Path) -> tuple[DictConfig | None, Path | None]:
    """``run_config`` of a local checkpoint; (None, None) for an ``s3://`` one, whose run dir is not at hand."""
    return (None, None) if object_store.is_url(ckpt_path) else run_config(Path(ckpt_path))


def data_to_test(
    data_cfg: DictConfig, run_cfg: DictConfig | None, config_file: Path | None, group_given: bool, keys: list[str]
) -> tuple[DictConfig, str]:
    """The data src.eval and src.export test a checkpoint on, and its name for their lines: the data of the run that
    wrote the checkpoint (``run_cfg`` from its ``config_file``: a run of ``data=synthetic`` or of another
    ``data.root`` is tested on its own test images, wherever the command starts), with the command line's ``data.*``
    ``keys`` set on it (``data.batch_size=64``); ``data_cfg``, the command line's, where it chose the group
    (``group_given``: ``data=cifar10``) or no config of the run was found (``run_config_of``)."""
    if group_given or run_cfg is None:
        return data_cfg, ""
    data = run_cfg.data
    given = {key: OmegaConf.select(data_cfg, key.split(".", 1)[1]) for key in keys}
    for key, value in given.items():  # data.batch_size: the command line's value, on the run's data
        OmegaConf.update(data, key.split(".", 1)[1], value, force_add=True)
    changed = f" with {', '.join(f'{key}={value}' for key, value in given.items())}" if given else ""
    return data, f"the run's data={DATAMODULES[data._target_]}{changed} ({config_file})"


def _plain_data(data: Any) -> bool:
    """Whether a config file's ``data`` builds one of the project's datamodules from plain values: a file beside a
    checkpoint is as untrusted as the checkpoint, and ``instantiate`` would import whatever ``_target_`` names."""
    return (
        isinstance(data, DictConfig)
        and data.get("_target_") in DATAMODULES
        and all(isinstance(v, (str, int, float, bool)) or v is None for v in data.values())
    )


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


class Normalised(nn.Module):
    """``net`` preceded by the training normalisation: input float RGB images in [0, 1]."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net
        self.register_buffer("mean", torch.tensor(CIFAR10_MEAN).view(1, 3, 1, 1))
        self.register_buffer("std", torch.tensor(CIFAR10_STD).view(1, 3, 1, 1))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.net((images - self.mean) / self.std)


def onnx_session(path: Path) -> Any:
    """An onnxruntime session on the CPU, quiet."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3  # errors only
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def torchvision_network(meta: dict[str, Any], weights: Path) -> Any:
    """The loader docs/export.md shows: torchvision's network, the CIFAR stem where ``meta`` says, the weights. A
    narrow network (``width`` below 64; an export from before it has none: 64) has no torchvision builder: the
    project's own ``NarrowResNet`` (a subclass of torchvision's ResNet) rebuilds it."""
    import torchvision
    from safetensors.torch import load_file

    from src.models.resnet import WIDTH, build_resnet

    width = int(meta.get("width", WIDTH))
    if width == WIDTH:
        net = torchvision.models.get_model(meta["arch"], num_classes=meta["num_classes"])
    else:
        net = build_resnet(meta["arch"], meta["num_classes"], "imagenet", width)
    if meta["stem"] == "cifar":
        net.conv1, net.maxpool = torch.nn.Conv2d(3, width, 3, 1, 1, bias=False), torch.nn.Identity()
    net.load_state_dict(load_file(weights))
    return net.eval()


def load_model(given: str | Path, trusted: bool) -> tuple[Callable[[torch.Tensor], torch.Tensor], list[str]]:
    """A function of float images in [0, 1] (N x 3 x 32 x 32) to logits, and the class names, for ``path``: a local
    file, or an ``s3://`` checkpoint (read from its node-local copy)."""
    if object_store.is_url(given):
        given = str(given)
        if not given.endswith(".ckpt"):
            raise UserError(
                f"ckpt_path={given}: an exported model is read from a local file (aws s3 cp it first); from an "
                "s3:// URL, src.predict reads a .ckpt of src.train"
            )
        model, _ = load_classifier(given, trusted)
        return Normalised(model.net).eval(), class_names(None, model.hparams.num_classes)
    path = Path(given)
    from src.checkpoints.files import cannot_read, not_a_file

    refused = not_a_file("ckpt_path", path, "a .ckpt of src.train, or a .onnx / .safetensors of src.export")
    if refused is not None:
        raise UserError(refused)
    if path.suffix in (".onnx", ".safetensors"):  # a .ckpt: read_checkpoint says so itself
        try:  # before: onnxruntime's "system error number 13", safetensors' "No such file or directory"
            path.open("rb").close()
        except OSError as err:
            raise UserError(cannot_read("ckpt_path", path, err)) from None
        return onnx_model(path) if path.suffix == ".onnx" else safetensors_model(path)
    model, _ = load_classifier(path, trusted)
    run_cfg, _ = run_config(path)
    return Normalised(model.net).eval(), class_names(
        run_cfg.data if run_cfg is not None else None, model.hparams.num_classes
    )


def onnx_model(path: Path) -> tuple[Callable[[torch.Tensor], torch.Tensor], list[str]]:
    """An onnxruntime session of an exported model; another input shape than N x 3 x 32 x 32 is refused."""
    require("onnxruntime", "export", f"ckpt_path={path.name}")
    try:
        session = onnx_session(path)
    except Exception as err:  # noqa: BLE001 - onnxruntime raises its own classes for any file it cannot load
        raise UserError(f"ckpt_path={path} is not an ONNX model onnxruntime can load ({one_line_of(err)})") from err
    inputs, outputs = session.get_inputs(), session.get_outputs()
    shape = list(inputs[0].shape) if len(inputs) == 1 else None
    if shape is None or len(shape) != 4 or shape[1:] != [3, IMAGE_SIZE, IMAGE_SIZE] or len(outputs[0].shape) != 2:
        described = ", ".join(f"{i.name} {i.shape}" for i in inputs)
        raise UserError(
            f"ckpt_path={path} is a model of another shape (input {described}): src.predict takes one "
            f"input of N x 3 x {IMAGE_SIZE} x {IMAGE_SIZE} images and N x classes logits, as src.export "
            "writes"
        )
    meta = session.get_modelmeta().custom_metadata_map
    count = outputs[0].shape[1] if isinstance(outputs[0].shape[1], int) else None
    names = json.loads(meta["class_names"]) if "class_names" in meta else None
    if names is None or (count is not None and len(names) != count):
        names = [f"class {i}" for i in range(count or 0)]
    name = inputs[0].name
    return (lambda images: torch.from_numpy(session.run(None, {name: images.numpy()})[0])), names


def safetensors_model(path: Path) -> tuple[Callable[[torch.Tensor], torch.Tensor], list[str]]:
    """The network rebuilt from an exported ``.safetensors`` and the JSON beside it."""
    require("safetensors", "export", f"ckpt_path={path.name}")

    described = path.with_suffix(".json")
    try:
        meta = json.loads(described.read_text())
    except (OSError, ValueError) as err:
        raise UserError(
            f"{described} cannot be read ({one_line_of(err)}): src.export writes it beside {path.name}, "
            "and the weights cannot be used without it"
        ) from err
    try:
        net = torchvision_network(meta, path)
    except (KeyError, TypeError, ValueError) as err:
        raise UserError(f"{described} does not describe a network ({one_line_of(err)}): export it again") from err
    except RuntimeError as err:
        raise UserError(
            f"ckpt_path={path} holds a model of another shape than {described} describes "
            f"({meta.get('arch')}, stem {meta.get('stem')}, {meta.get('num_classes')} classes: "
            f"{one_line_of(err)})"
        ) from err
    except Exception as err:  # noqa: BLE001 - safetensors' own errors for a damaged file
        raise UserError(f"ckpt_path={path} is not a readable safetensors file ({one_line_of(err)})") from err
    names = meta.get("class_names") or [f"class {i}" for i in range(meta["num_classes"])]
    return Normalised(net).eval(), names


def one_line_of(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
