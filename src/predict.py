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
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from src.cli.entry import handle_errors, run
from src.core import startup
from src.core.errors import UserError

log = logging.getLogger("src.predict")


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
    top = probabilities.topk(min(top_k, probabilities.shape[1]), dim=1)
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
            Path(cfg.json).write_text(json.dumps(predictions, indent=2) + "\n")
            log.info("predictions of %d images in %s", len(predictions), cfg.json)
    return predictions


def json_flag(argv: list[str]) -> list[str]:
    """``--json`` (JSON on stdout) and ``--json=PATH`` as the Hydra key ``json``."""
    return [
        ("json=-" if a == "--json" else f"json={a[len('--json=') :]}" if a.startswith("--json=") else a) for a in argv
    ]


if __name__ == "__main__":
    sys.argv = json_flag(sys.argv)
    run(main)  # Hydra's own rejections (unknown option, misspelled key) in one line too
