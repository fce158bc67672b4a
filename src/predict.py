"""``python -m src.predict ckpt_path=PATH images=FILE|DIR [top_k=3] [--json]``: the top classes of each image.

The model is a checkpoint of src.train, or an ``.onnx`` / ``.safetensors`` written by src.export. Images are PNG,
JPEG, GIF or WebP files, read as a viewer shows them (``read_image``); the networks here are trained on 32x32
CIFAR-style images, and other sizes are resized to 32x32.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from src.cli.entry import handle_errors, run
from src.core import startup
from src.core.errors import UserError, check_number, whole

log = logging.getLogger("src.predict")


@hydra.main(version_base="1.3", config_path="../conf", config_name="predict")
@handle_errors
def main(cfg: DictConfig) -> list[dict[str, Any]]:
    """Classify ``images`` with ``ckpt_path``; print each image's top ``top_k`` classes (or JSON)."""
    if OmegaConf.is_missing(cfg, "ckpt_path") or not cfg.ckpt_path:
        raise UserError("ckpt_path=PATH is required: a .ckpt of src.train, or a .onnx / .safetensors of src.export")
    if OmegaConf.is_missing(cfg, "images") or not cfg.images:
        raise UserError("images=PATH is required: a PNG or JPEG file, a folder of them, or a list [a.png,b.jpg]")
    check_predict_settings(cfg)
    import torch  # torch and the model's code load here: not for --help, --cfg or a mistake in the command line

    from src.serving.formats import load_model
    from src.serving.images import image_files, read_image

    startup.resume()  # loaded: the garbage collector on again (src/core/startup.py)
    classify, names = load_model(str(cfg.ckpt_path), cfg.ckpt_trusted)
    files = image_files(cfg.images)
    images = [read_image(f) for f in files]
    batch = torch.stack([image for image, _ in images])
    with torch.inference_mode():
        probabilities = torch.cat(
            [
                classify(batch[i : i + cfg.batch_size]).float().softmax(dim=1)
                for i in range(0, len(batch), cfg.batch_size)
            ]
        )
    top = probabilities.topk(min(cfg.top_k, probabilities.shape[1]), dim=1)
    predictions = [
        {
            "image": str(f),
            "resized_from": size,
            "top": [
                {"class": names[i], "index": int(i), "probability": round(float(p), 6)} for p, i in zip(values, indices)
            ],
        }
        for f, (_, size), values, indices in zip(files, images, top.values, top.indices)
    ]
    if cfg.json == "-":
        print(json.dumps(predictions, indent=2))
    else:
        width = max(len(p["image"]) for p in predictions)
        for p in predictions:
            resized = f"  (resized from {p['resized_from'][0]}x{p['resized_from'][1]})" if p["resized_from"] else ""
            print(
                f"{p['image']:<{width}}  "
                + "  ".join(f"{t['class']} {t['probability']:.3f}" for t in p["top"])
                + resized
            )
        if cfg.json:
            try:
                Path(str(cfg.json)).write_text(json.dumps(predictions, indent=2) + "\n")
            except OSError as err:
                raise UserError(f"json={cfg.json} cannot be written ({err.strerror}): pass another path") from err
            log.info("predictions of %d images in %s", len(predictions), cfg.json)
    return predictions


def check_predict_settings(cfg: DictConfig) -> None:
    """``top_k``, ``batch_size`` (0 was range()'s ValueError and a traceback) and ``json``, before any image is read."""
    check_number("top_k", cfg.top_k, whole(1), "a whole number >= 1")
    check_number("batch_size", cfg.batch_size, whole(1), "a whole number >= 1: the images of one forward pass")
    check_json_path(cfg.json)


def check_json_path(given: Any) -> None:
    """``json``: null, ``-`` (stdout) or a file in a folder that exists and takes writes (before, a missing folder
    ended the run after its predictions with a line about a run dir that vanished)."""
    if given is None or given == "-":
        return
    if isinstance(given, bool) or not str(given):
        raise UserError(f"json={given} must be a file path, or - to print JSON instead")
    folder = Path(str(given)).parent
    if not folder.is_dir():
        raise UserError(f"json={given}: the folder {folder} does not exist: create it, or pass another path")
    if not os.access(folder, os.W_OK):
        raise UserError(f"json={given}: the folder {folder} is not writable: pass another path")


def json_flag(argv: list[str]) -> list[str]:
    """``--json`` (JSON on stdout) and ``--json=PATH`` as the Hydra key ``json``."""
    return [
        ("json=-" if a == "--json" else f"json={a[len('--json=') :]}" if a.startswith("--json=") else a) for a in argv
    ]


if __name__ == "__main__":
    sys.argv = json_flag(sys.argv)
    run(main)  # Hydra's own rejections (unknown option, misspelled key) in one line too
