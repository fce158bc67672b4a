"""Image files as a viewer shows them: PNG, JPEG, GIF or WebP, orientation, bit depth, palette and transparency
taken into account, resized to the 32x32 the networks here are trained on.

What cannot be shown as one still RGB picture (an animation, a truncated file, a sliver) is one UserError naming the
file; nothing is guessed.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from omegaconf import ListConfig

from src.core.errors import UserError, closed_folder
from src.serving.formats import IMAGE_SIZE

log = logging.getLogger(__name__)


SUFFIXES = (".png", ".jpg", ".jpeg", ".gif", ".webp")


MIN_SIDE = 8  # pixels: smaller, a 32x32 copy is made up


MAX_ASPECT = 3  # longer side over shorter: beyond, squeezing to a square distorts what the image shows


def image_files(images: Any) -> list[Path]:
    """The files ``images=`` names: files, folders (their PNG and JPEG files, sorted), or a list of either."""
    given = list(images) if isinstance(images, (list, tuple, ListConfig)) else [images]
    files: list[Path] = []
    for item in map(Path, map(str, given)):
        try:
            if item.is_dir():
                found = sorted(p for p in item.iterdir() if p.suffix.lower() in SUFFIXES and p.is_file())
                if not found:
                    raise UserError(f"images={item} holds no PNG, JPEG, GIF or WebP file")
                files += found
            elif item.is_file():
                files.append(item)
            else:
                raise UserError(f"images={item} does not exist: pass image files or a folder of them")
        except PermissionError as err:  # a folder that may not be entered or listed: before, 'cannot write ...'
            raise UserError(
                f"images={item} cannot be read ({err.strerror} on {closed_folder(item, err)}): fix that folder's "
                "permissions, or pass other images"
            ) from None
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
        content = bytearray(path.read_bytes())
    except OSError as err:  # before: 'cannot be decoded as an image', for a file that could not be read
        raise UserError(f"{path} cannot be read ({err.strerror}): fix its permissions, or pass other images") from None
    try:
        data = torch.frombuffer(content, dtype=torch.uint8)  # an empty file: a ValueError, as a damaged one
        # the file's own channels (grey, grey + alpha, RGB, RGBA), at its own depth (uint8 or uint16)
        raw = decode_image(data, mode=ImageReadMode.UNCHANGED, apply_exif_orientation=True)
        # palette and grey-scale images in RGB: decode_image expands them (a palette PNG's UNCHANGED is its indices)
        rgb = raw if raw.shape[-3] == 3 else decode_image(data, mode=ImageReadMode.RGB, apply_exif_orientation=True)
    except (RuntimeError, ValueError, OSError) as err:
        raise UserError(
            f"{path} cannot be decoded as an image (not a PNG, JPEG, GIF or WebP file, or a damaged or "
            "truncated one): pass PNG or JPEG files"
        ) from err
    if raw.ndim == 4:  # GIF: frames x channels x height x width
        if raw.shape[0] > 1:
            raise UserError(
                f"{path} is an animation of {raw.shape[0]} frames, not one image: save the frame to "
                "classify as a PNG or JPEG"
            )
        raw, rgb = raw[0], rgb[0]
    height, width = rgb.shape[-2:]
    if min(height, width) < MIN_SIDE or max(height, width) > MAX_ASPECT * min(height, width):
        raise UserError(
            f"{path} is {width}x{height}: too {'small' if min(height, width) < MIN_SIDE else 'elongated'} "
            f"to make a 32x32 image of what it shows (the networks know CIFAR-10's 32x32 photos): crop "
            f"it to at most {MAX_ASPECT}:1, and at least {MIN_SIDE} pixels a side"
        )
    image = F.to_dtype(rgb, torch.float32, scale=True)  # uint8 / 255, uint16 / 65535
    if raw.shape[-3] in (2, 4):  # an alpha channel: composited over white, as a viewer shows a transparent pixel
        alpha = F.to_dtype(raw[-1:], torch.float32, scale=True)
        image = image * alpha + (1 - alpha)
    size = None
    if (height, width) != (IMAGE_SIZE, IMAGE_SIZE):
        size = [int(width), int(height)]
        image = F.resize(image, [IMAGE_SIZE, IMAGE_SIZE], antialias=True).clamp_(0, 1)
    return image, size
