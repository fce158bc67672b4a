"""``python -m src.predict ckpt_path=PATH images=FILE|DIR [top_k=3] [--json]``: the top classes of each image.

The model is a checkpoint of src.train, or an ``.onnx`` / ``.safetensors`` written by src.export. Images are PNG,
JPEG, GIF or WebP files, read as a viewer shows them (``read_image``); the networks here are trained on 32x32
CIFAR-style images, and other sizes are resized to 32x32.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any, Callable

import hydra
import torch
from omegaconf import DictConfig, ListConfig, OmegaConf

from src.entry import handle_errors, run
from src.errors import UserError, require
from src.export import IMAGE_SIZE, Normalised, class_names, load_classifier, onnx_session, run_config

log = logging.getLogger("src.predict")

SUFFIXES = (".png", ".jpg", ".jpeg", ".gif", ".webp")
MIN_SIDE = 8  # pixels: smaller, a 32x32 copy is made up
MAX_ASPECT = 3  # longer side over shorter: beyond, squeezing to a square distorts what the image shows


@hydra.main(version_base="1.3", config_path="../conf", config_name="predict")
@handle_errors
def main(cfg: DictConfig) -> list[dict[str, Any]]:
    """Classify ``images`` with ``ckpt_path``; print each image's top ``top_k`` classes (or JSON)."""
    if OmegaConf.is_missing(cfg, "ckpt_path") or not cfg.ckpt_path:
        raise UserError("ckpt_path=PATH is required: a .ckpt of src.train, or a .onnx / .safetensors of src.export")
    if OmegaConf.is_missing(cfg, "images") or not cfg.images:
        raise UserError("images=PATH is required: a PNG or JPEG file, a folder of them, or a list [a.png,b.jpg]")
    top_k = cfg.top_k
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise UserError(f"top_k={top_k} must be a whole number >= 1")
    classify, names = load_model(Path(cfg.ckpt_path), cfg.ckpt_trusted)
    files = image_files(cfg.images)
    images = [read_image(f) for f in files]
    batch = torch.stack([image for image, _ in images])
    with torch.inference_mode():
        probabilities = torch.cat([classify(batch[i:i + cfg.batch_size]).float().softmax(dim=1)
                                   for i in range(0, len(batch), cfg.batch_size)])
    top = probabilities.topk(min(top_k, probabilities.shape[1]), dim=1)
    predictions = [{"image": str(f), "resized_from": size,
                    "top": [{"class": names[i], "index": int(i), "probability": round(float(p), 6)}
                            for p, i in zip(values, indices)]}
                   for f, (_, size), values, indices in zip(files, images, top.values, top.indices)]
    if cfg.json == "-":
        print(json.dumps(predictions, indent=2))
    else:
        width = max(len(p["image"]) for p in predictions)
        for p in predictions:
            resized = f"  (resized from {p['resized_from'][0]}x{p['resized_from'][1]})" if p["resized_from"] else ""
            print(f"{p['image']:<{width}}  " + "  ".join(f"{t['class']} {t['probability']:.3f}" for t in p["top"])
                  + resized)
        if cfg.json:
            Path(cfg.json).write_text(json.dumps(predictions, indent=2) + "\n")
            log.info("predictions of %d images in %s", len(predictions), cfg.json)
    return predictions


def load_model(path: Path, trusted: bool) -> tuple[Callable[[torch.Tensor], torch.Tensor], list[str]]:
    """A function of float images in [0, 1] (N x 3 x 32 x 32) to logits, and the class names, for ``path``."""
    if not path.is_file():
        raise UserError(f"ckpt_path={path} does not exist: pass a .ckpt of src.train, or a .onnx / .safetensors of "
                        "src.export")
    if path.suffix == ".onnx":
        return onnx_model(path)
    if path.suffix == ".safetensors":
        return safetensors_model(path)
    model, _ = load_classifier(path, trusted)
    run_cfg, _ = run_config(path)
    return Normalised(model.net).eval(), class_names(run_cfg.data if run_cfg is not None else None,
                                                     model.hparams.num_classes)


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
        raise UserError(f"ckpt_path={path} is a model of another shape (input {described}): src.predict takes one "
                        f"input of N x 3 x {IMAGE_SIZE} x {IMAGE_SIZE} images and N x classes logits, as src.export "
                        "writes")
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
    from src.export import torchvision_network

    described = path.with_suffix(".json")
    try:
        meta = json.loads(described.read_text())
    except (OSError, ValueError) as err:
        raise UserError(f"{described} cannot be read ({one_line_of(err)}): src.export writes it beside {path.name}, "
                        "and the weights cannot be used without it") from err
    try:
        net = torchvision_network(meta, path)
    except (KeyError, TypeError, ValueError) as err:
        raise UserError(f"{described} does not describe a network ({one_line_of(err)}): export it again") from err
    except RuntimeError as err:
        raise UserError(f"ckpt_path={path} holds a model of another shape than {described} describes "
                        f"({meta.get('arch')}, stem {meta.get('stem')}, {meta.get('num_classes')} classes: "
                        f"{one_line_of(err)})") from err
    except Exception as err:  # noqa: BLE001 - safetensors' own errors for a damaged file
        raise UserError(f"ckpt_path={path} is not a readable safetensors file ({one_line_of(err)})") from err
    names = meta.get("class_names") or [f"class {i}" for i in range(meta["num_classes"])]
    return Normalised(net).eval(), names


def image_files(images: Any) -> list[Path]:
    """The files ``images=`` names: files, folders (their PNG and JPEG files, sorted), or a list of either."""
    given = list(images) if isinstance(images, (list, tuple, ListConfig)) else [images]
    files: list[Path] = []
    for item in map(Path, map(str, given)):
        if item.is_dir():
            found = sorted(p for p in item.iterdir() if p.suffix.lower() in SUFFIXES and p.is_file())
            if not found:
                raise UserError(f"images={item} holds no PNG, JPEG, GIF or WebP file")
            files += found
        elif item.is_file():
            files.append(item)
        else:
            raise UserError(f"images={item} does not exist: pass image files or a folder of them")
    return files


def read_image(path: Path) -> tuple[torch.Tensor, list[int] | None]:
    """One image as float RGB in [0, 1], 3 x 32 x 32, as a viewer shows it, and its width and height where it had to
    be resized (with antialiasing) to that.

    What a viewer shows: a JPEG turned as its EXIF orientation says; 16-bit PNGs scaled by 65535, not 255; grey-scale
    and palette images in their colours; a transparent pixel over white. A GIF or WebP of one frame is an image too.
    """
    from torchvision.io import ImageReadMode, decode_image
    from torchvision.transforms.v2 import functional as F

    try:
        # the file's own channels (grey, grey + alpha, RGB, RGBA), at its own depth (uint8 or uint16)
        raw = decode_image(str(path), mode=ImageReadMode.UNCHANGED, apply_exif_orientation=True)
        # palette and grey-scale images in RGB: decode_image expands them (a palette PNG's UNCHANGED is its indices)
        rgb = raw if raw.shape[-3] == 3 else decode_image(str(path), mode=ImageReadMode.RGB,
                                                            apply_exif_orientation=True)
    except (RuntimeError, ValueError, OSError) as err:
        raise UserError(f"{path} cannot be decoded as an image (not a PNG, JPEG, GIF or WebP file, or a damaged or "
                        "truncated one): pass PNG or JPEG files") from err
    if raw.ndim == 4:  # GIF: frames x channels x height x width
        if raw.shape[0] > 1:
            raise UserError(f"{path} is an animation of {raw.shape[0]} frames, not one image: save the frame to "
                            "classify as a PNG or JPEG")
        raw, rgb = raw[0], rgb[0]
    height, width = rgb.shape[-2:]
    if min(height, width) < MIN_SIDE or max(height, width) > MAX_ASPECT * min(height, width):
        raise UserError(f"{path} is {width}x{height}: too {'small' if min(height, width) < MIN_SIDE else 'elongated'} "
                        f"to make a 32x32 image of what it shows (the networks know CIFAR-10's 32x32 photos): crop "
                        f"it to at most {MAX_ASPECT}:1, and at least {MIN_SIDE} pixels a side")
    image = F.to_dtype(rgb, torch.float32, scale=True)  # uint8 / 255, uint16 / 65535
    if raw.shape[-3] in (2, 4):  # an alpha channel: composited over white, as a viewer shows a transparent pixel
        alpha = F.to_dtype(raw[-1:], torch.float32, scale=True)
        image = image * alpha + (1 - alpha)
    size = None
    if (height, width) != (IMAGE_SIZE, IMAGE_SIZE):
        size = [int(width), int(height)]
        image = F.resize(image, [IMAGE_SIZE, IMAGE_SIZE], antialias=True).clamp_(0, 1)
    return image, size


def one_line_of(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def json_flag(argv: list[str]) -> list[str]:
    """``--json`` (JSON on stdout) and ``--json=PATH`` as the Hydra key ``json``."""
    return [("json=-" if a == "--json" else f"json={a[len('--json='):]}" if a.startswith("--json=") else a)
            for a in argv]


if __name__ == "__main__":
    sys.argv = json_flag(sys.argv)
    run(main)  # Hydra's own rejections (unknown option, misspelled key) in one line too
