"""`python -m src.predict`: the classes src.eval's model gives, from a checkpoint, an ONNX or a safetensors file."""

from __future__ import annotations

import json
import pickle
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from PIL import Image

from src.core.errors import UserError
from src.data.in_memory import eval_transform
from src.predict import json_flag
from src.serving.formats import load_classifier, load_model
from src.serving.images import image_files, read_image
from tests.conftest import ROOT, needs_sample, output, refusal_lines, run_module, without_root_permissions

COUNT = 6  # PNG files written from the sample's first test images


@pytest.fixture(scope="module")
def sample_pngs(tmp_path_factory) -> tuple[Path, torch.Tensor]:
    """The sample's first COUNT test images as PNG files (a folder), and the same images as uint8 tensors."""
    with open(needs_sample() / "cifar-10-batches-py" / "test_batch", "rb") as f:
        test = pickle.load(f, encoding="latin1")
    images = test["data"][:COUNT].reshape(-1, 3, 32, 32)
    folder = tmp_path_factory.mktemp("pngs")
    for i, image in enumerate(images):
        Image.fromarray(image.transpose(1, 2, 0)).save(folder / f"{i}.png")
    return folder, torch.from_numpy(images.copy())


def eval_classes(checkpoint: Path, images: torch.Tensor) -> list[int]:
    """The classes of ``images`` as src.eval's model sees them: the checkpoint's network after the datamodule's
    test transform."""
    model, _ = load_classifier(checkpoint, trusted=False)
    with torch.inference_mode():
        return model(torch.stack([eval_transform()(image) for image in images])).argmax(1).tolist()


@pytest.mark.parametrize("kind", ["last.ckpt", "last.onnx", "last.safetensors"])
def test_predict_gives_the_classes_src_evals_model_gives_for_pngs_of_the_sample(
    kind, sample_checkpoint, exported_sample_model, sample_pngs, tmp_path
):
    folder, images = sample_pngs
    model = sample_checkpoint / "checkpoints" / kind if kind.endswith(".ckpt") else exported_sample_model[0] / kind
    result = run_module(
        "src.predict",
        f"ckpt_path={model}",
        f"images={folder}",
        "top_k=3",
        f"json={tmp_path / 'p.json'}",
        f"hydra.run.dir={tmp_path}/run",
    )
    assert result.returncode == 0, output(result)[-3000:]
    predictions = json.loads((tmp_path / "p.json").read_text())
    assert [Path(p["image"]).name for p in predictions] == [f"{i}.png" for i in range(COUNT)]
    expected = eval_classes(sample_checkpoint / "checkpoints" / "last.ckpt", images)
    assert [p["top"][0]["index"] for p in predictions] == expected
    for p in predictions:
        probabilities = [t["probability"] for t in p["top"]]
        assert len(p["top"]) == 3 and probabilities == sorted(probabilities, reverse=True) and sum(probabilities) <= 1
        assert p["resized_from"] is None
    names = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
    assert all(t["class"] == names[t["index"]] for p in predictions for t in p["top"])
    table = [line for line in result.stdout.splitlines() if line.startswith(str(folder))]
    assert len(table) == COUNT and f" {names[expected[0]]} " in table[0]


def test_an_image_of_another_size_is_resized_to_32x32_and_said_so(sample_pngs, tmp_path):
    folder, images = sample_pngs
    Image.open(folder / "0.png").resize((64, 48)).save(tmp_path / "big.jpg")
    image, size = read_image(tmp_path / "big.jpg")
    assert image.shape == (3, 32, 32) and size == [64, 48] and 0 <= image.min() and image.max() <= 1
    same, size = read_image(folder / "0.png")
    assert size is None and torch.equal((same * 255).round().to(torch.uint8), images[0])


def png16(path: Path, pixels: np.ndarray) -> None:
    """A 16-bit PNG (grey, grey + alpha, RGB or RGBA: H x W x C uint16), which Pillow cannot write."""
    height, width, channels = pixels.shape
    rows = b"".join(b"\0" + row.astype(">u2").tobytes() for row in pixels)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 16, {1: 0, 2: 4, 3: 2, 4: 6}[channels], 0, 0, 0)
    path.write_bytes(
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b"")
    )


def encodings(image: np.ndarray, folder: Path) -> list[tuple[str, str]]:
    """``image`` (32 x 32 x 3 uint8) written as a user's files come, each beside the plain file it must read as."""
    folder.mkdir()
    rgb, grey = Image.fromarray(image), Image.fromarray(image).convert("L")
    palette = rgb.convert("P", palette=Image.Palette.ADAPTIVE, colors=64)
    half = np.dstack([image, np.full((32, 32), 128, np.uint8)])  # half transparent: over white, as a viewer shows it
    over_white = (image.astype(np.float64) * 128 / 255 + 255 * (1 - 128 / 255)).round().astype(np.uint8)
    files = {
        "rgb.png": rgb,
        "grey-as-rgb.png": grey.convert("RGB"),
        "palette-as-rgb.png": palette.convert("RGB"),
        "grey.png": grey,
        "palette.png": palette,
        "rgba.png": rgb.convert("RGBA"),
        "grey-alpha.png": grey.convert("LA"),
        "half-transparent.png": Image.fromarray(half, "RGBA"),
        "over-white.png": Image.fromarray(over_white),
        "still.gif": palette,
        "still.webp": rgb,
    }
    for name, picture in files.items():
        picture.save(folder / name, **({"lossless": True} if name.endswith(".webp") else {}))
    png16(folder / "rgb16.png", image.astype(np.uint16) * 257)
    png16(folder / "grey16.png", np.asarray(grey).astype(np.uint16)[..., None] * 257)
    png16(folder / "rgba16.png", np.dstack([image, np.full((32, 32), 255, np.uint8)]).astype(np.uint16) * 257)
    rgb.save(folder / "upright.jpg", quality=95)
    turned = Image.Exif()
    turned[0x0112] = 6  # a phone held upright: the pixels lie turned, and the tag says to turn them back 90° clockwise
    rgb.transpose(Image.Transpose.ROTATE_90).save(folder / "phone.jpg", quality=95, exif=turned.tobytes())
    return [
        ("rgb16.png", "rgb.png"),
        ("rgba.png", "rgb.png"),
        ("rgba16.png", "rgb.png"),
        ("still.webp", "rgb.png"),
        ("grey.png", "grey-as-rgb.png"),
        ("grey16.png", "grey-as-rgb.png"),
        ("grey-alpha.png", "grey-as-rgb.png"),
        ("palette.png", "palette-as-rgb.png"),
        ("still.gif", "palette-as-rgb.png"),
        ("half-transparent.png", "over-white.png"),
        ("phone.jpg", "upright.jpg"),
    ]


def test_every_encoding_of_an_image_gives_the_classes_and_probabilities_of_the_image_itself(
    sample_checkpoint, sample_pngs, tmp_path
):
    """16-bit, grey-scale, palette, alpha, GIF, WebP and an EXIF-turned JPEG read as a viewer shows them: the same
    top classes with the same probabilities (within 0.01; the turned JPEG within 0.02 of the upright one) as the
    plain file. Top-1 alone would not do: a ReLU network scales with its input, so an image read 257 times too bright
    can keep its top class.

    The two JPEGs are two lossy encodings of one picture, on block grids turned against each other: on the first 8
    of the sample's images they differed by up to 0.012 for the sample's model, and by 0.07 to 0.72 where the turn
    the EXIF tag asks for was left out (the other pairs: 0.002 at most)."""
    classify, _ = load_model(sample_checkpoint / "checkpoints" / "last.ckpt", trusted=False)
    _, images = sample_pngs
    for n, image in enumerate(images[:3]):
        folder = tmp_path / str(n)
        pairs = encodings(image.numpy().transpose(1, 2, 0), folder)
        names = sorted({name for pair in pairs for name in pair})
        read = {name: read_image(folder / name) for name in names}
        assert all(size is None for _, size in read.values())
        with torch.inference_mode():
            probabilities = dict(zip(names, classify(torch.stack([read[name][0] for name in names])).softmax(1)))
        for encoded, plain in pairs:
            got, want = probabilities[encoded], probabilities[plain]
            within = 0.02 if encoded.endswith(".jpg") else 0.01
            assert (got - want).abs().max() < within, (n, encoded, (got - want).abs().max())
            # the top 3 in the plain file's order, wherever it has them more than 0.02 apart: a near tie may fall
            # either way between two JPEG encodings of one picture (classes 0.003 apart swapped, in fp32)
            top = want.topk(3).indices.tolist()
            apart = [(a, b) for i, a in enumerate(top) for b in top[i + 1 :] if want[a] - want[b] > 0.02]
            assert all(got[a] > got[b] for a, b in apart) and got.topk(1).indices.item() == top[0], (n, encoded)
        assert (probabilities["rgb16.png"] - probabilities["rgb.png"]).abs().max() < 1e-4  # the same pixels exactly


def test_an_animation_a_truncated_file_and_a_shape_far_from_a_photos_are_one_line_each(sample_pngs, tmp_path):
    folder, _ = sample_pngs
    frame = Image.open(folder / "0.png")
    frame.save(tmp_path / "anim.gif", save_all=True, append_images=[frame.transpose(Image.Transpose.FLIP_LEFT_RIGHT)])
    with pytest.raises(UserError, match=r"anim.gif is an animation of 2 frames, not one image: save the frame"):
        read_image(tmp_path / "anim.gif")
    for name in ("0.png", "upright.jpg"):
        frame.save(tmp_path / name, quality=95)
        whole = (tmp_path / name).read_bytes()
        (tmp_path / f"cut-{name}").write_bytes(whole[: len(whole) // 2])
        with pytest.raises(UserError, match=rf"cut-{name} cannot be decoded as an image .* damaged or truncated one"):
            read_image(tmp_path / f"cut-{name}")
    frame.resize((320, 40)).save(tmp_path / "strip.png")
    with pytest.raises(UserError, match=r"strip.png is 320x40: too elongated .* crop it to at most 3:1"):
        read_image(tmp_path / "strip.png")
    frame.resize((6, 6)).save(tmp_path / "icon.png")
    with pytest.raises(UserError, match=r"icon.png is 6x6: too small .* at least 8 pixels a side"):
        read_image(tmp_path / "icon.png")


def test_an_undecodable_image_is_one_error_line(sample_checkpoint, tmp_path):
    (tmp_path / "notes.png").write_text("not an image")
    result = run_module(
        "src.predict",
        f"ckpt_path={sample_checkpoint}/checkpoints/last.ckpt",
        f"images={tmp_path / 'notes.png'}",
        f"hydra.run.dir={tmp_path}/run",
    )
    assert result.returncode == 2 and "Traceback" not in output(result), output(result)[-3000:]
    assert output(result).strip().splitlines()[-1] == (
        f"error: {tmp_path / 'notes.png'} cannot be decoded as an image (not a PNG, JPEG, GIF or WebP file, or a "
        "damaged or truncated one): pass PNG or JPEG files"
    )


def read_checkpoint_as_resume(path):
    from src.checkpoints.files import read_checkpoint

    return read_checkpoint(path, key="resume")


def test_predicts_own_values_are_refused_before_any_image_is_read(tmp_path):
    from src.predict import check_predict_settings

    defaults = OmegaConf.load(ROOT / "conf" / "predict.yaml")
    for json_path in (None, "-", str(tmp_path / "p.json")):
        check_predict_settings(OmegaConf.merge(defaults, {"json": json_path}))
    for key, value, words in [
        ("batch_size", 0, "batch_size=0 must be a whole number >= 1"),  # before: range()'s ValueError, a traceback
        ("top_k", 1.5, "top_k=1.5 must be a whole number >= 1"),
        # before: a missing folder was found once the predictions were made, and called a run dir that vanished
        ("json", f"{tmp_path}/no/p.json", f"json={tmp_path}/no/p.json: the folder {tmp_path}/no does not exist"),
        ("json", True, "json=True must be a file path, or - to print JSON"),
    ]:
        with pytest.raises(UserError) as refused:
            check_predict_settings(OmegaConf.merge(defaults, {key: value}))
        assert str(refused.value).startswith(words)


def test_missing_files_and_empty_folders_are_refused(tmp_path):
    with pytest.raises(UserError, match=r"images=.*nope.png does not exist"):
        image_files([str(tmp_path / "nope.png")])
    with pytest.raises(UserError, match="holds no PNG, JPEG, GIF or WebP file"):
        image_files(str(tmp_path))
    with pytest.raises(UserError, match=r"ckpt_path=.*gone.onnx does not exist"):
        load_model(tmp_path / "gone.onnx", trusted=False)
    # a folder is not called missing: a run dir names its newest checkpoint, last.ckpt first (before: "does not exist")
    with pytest.raises(UserError, match=r"ckpt_path=.* is a folder and holds no \.ckpt file: pass a \.ckpt of src"):
        load_model(tmp_path, trusted=False)
    (tmp_path / "checkpoints").mkdir()
    for name in ("last.ckpt", "best-epoch009-acc0.9000.ckpt"):  # the best written after last.ckpt
        (tmp_path / "checkpoints" / name).write_bytes(b"")
    for key, read in (("ckpt_path", lambda p: load_model(p, trusted=False)), ("resume", read_checkpoint_as_resume)):
        with pytest.raises(UserError) as refused:
            read(tmp_path)
        assert (
            str(refused.value)
            == f"{key}={tmp_path} is a folder: pass a file in it, such as {key}={tmp_path}/checkpoints/last.ckpt"
        )


def test_a_model_of_another_shape_is_refused(exported_sample_model, tmp_path):
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Identity", ["images"], ["logits"])],
        "wide",
        [helper.make_tensor_value_info("images", TensorProto.FLOAT, ["N", 3, 224, 224])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 3, 224, 224])],
    )
    onnx.save(helper.make_model(graph), tmp_path / "wide.onnx")
    with pytest.raises(UserError, match=r"wide.onnx is a model of another shape \(input images \['N', 3, 224, 224\]\)"):
        load_model(tmp_path / "wide.onnx", trusted=False)
    out = exported_sample_model[0]
    (tmp_path / "w.safetensors").write_bytes((out / "last.safetensors").read_bytes())
    meta = json.loads((out / "last.json").read_text())
    (tmp_path / "w.json").write_text(json.dumps({**meta, "arch": "resnet34"}))  # weights of a resnet18
    with pytest.raises(
        UserError,
        match=r"w.safetensors holds a model of another shape than .*w.json describes "
        r"\(resnet34, stem imagenet, 10 classes",
    ):
        load_model(tmp_path / "w.safetensors", trusted=False)


def test_dash_dash_json_is_the_json_key():
    assert json_flag(["src.predict", "--json", "images=a.png"]) == ["src.predict", "json=-", "images=a.png"]
    assert json_flag(["src.predict", "--json=out.json"]) == ["src.predict", "json=out.json"]


def test_dash_dash_json_prints_json_alone_on_stdout(sample_checkpoint, sample_pngs, tmp_path):
    folder, _ = sample_pngs
    result = run_module(
        "src.predict",
        f"ckpt_path={sample_checkpoint}/checkpoints/last.ckpt",
        f"images=[{folder / '1.png'},{folder / '2.png'}]",
        "top_k=1",
        "--json",
        f"hydra.run.dir={tmp_path}/run",
    )
    assert result.returncode == 0, output(result)[-3000:]
    predictions = json.loads(result.stdout)
    assert [Path(p["image"]).name for p in predictions] == ["1.png", "2.png"]
    assert all(len(p["top"]) == 1 and 0 < p["top"][0]["probability"] <= 1 for p in predictions)


def _image_refusals(paths: list[str]) -> list[str]:
    return refusal_lines(lambda path: [read_image(file) for file in image_files(path)], paths, taken="read")


def test_images_behind_permissions_and_an_empty_file_are_one_line_each(tmp_path):
    """Before: a folder that may not be listed or entered was 'cannot write ...: there is no intact last.ckpt yet'
    (src.predict writes no checkpoint), a file that may not be read 'cannot be decoded as an image'; an empty file is
    as damaged as a truncated one."""
    Image.new("RGB", (32, 32)).save(tmp_path / "ok.png")
    (tmp_path / "empty.png").write_bytes(b"")
    (tmp_path / "shut").mkdir()
    Image.new("RGB", (32, 32)).save(tmp_path / "shut" / "a.png")
    (tmp_path / "unreadable.png").write_bytes((tmp_path / "ok.png").read_bytes())
    (tmp_path / "unreadable.png").chmod(0o000)
    shut = f"{tmp_path}/shut"
    (tmp_path / "shut").chmod(0o000)
    try:
        lines = without_root_permissions(
            _image_refusals, [f"{tmp_path}/ok.png", shut, f"{shut}/a.png", f"{tmp_path}/unreadable.png"]
        )
    finally:
        (tmp_path / "shut").chmod(0o755)
    fix = "fix that folder's permissions, or pass other images"
    assert lines == [
        "read",
        f"images={shut} cannot be read (Permission denied on {shut}): {fix}",
        f"images={shut}/a.png cannot be read (Permission denied on {shut}): {fix}",
        f"{tmp_path}/unreadable.png cannot be read (Permission denied): fix its permissions, or pass other images",
    ]
    with pytest.raises(UserError, match=r"empty.png cannot be decoded as an image .* damaged or truncated one"):
        read_image(tmp_path / "empty.png")


def test_an_exported_model_or_checkpoint_that_may_not_be_read_is_one_line_saying_so(tmp_path):
    """Before: onnxruntime's `system error number 13` and safetensors' `No such file or directory` for a file that
    is there, unreadable."""
    for name in ("m.onnx", "m.safetensors", "m.ckpt"):
        (tmp_path / name).write_bytes(b"x")
        (tmp_path / name).chmod(0o000)
    paths = [f"{tmp_path}/{name}" for name in ("m.onnx", "m.safetensors", "m.ckpt")]
    lines = without_root_permissions(refusal_lines, lambda path: load_model(path, trusted=False), paths)
    assert lines == [
        f"ckpt_path={path} cannot be read (Permission denied): fix its permissions, or pass another checkpoint"
        for path in paths
    ]
