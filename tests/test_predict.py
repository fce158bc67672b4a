"""`python -m src.predict`: the classes src.eval's model gives, from a checkpoint, an ONNX or a safetensors file."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch
from PIL import Image

from src.data.in_memory import eval_transform
from src.errors import UserError
from src.export import load_classifier
from src.predict import image_files, json_flag, load_model, read_image
from tests.conftest import SAMPLE, output, run_module

COUNT = 6  # PNG files written from the sample's first test images


@pytest.fixture(scope="module")
def sample_pngs(tmp_path_factory) -> tuple[Path, torch.Tensor]:
    """The sample's first COUNT test images as PNG files (a folder), and the same images as uint8 tensors."""
    with open(SAMPLE / "cifar-10-batches-py" / "test_batch", "rb") as f:
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
def test_predict_gives_the_classes_src_evals_model_gives_for_pngs_of_the_sample(kind, sample_checkpoint,
                                                                                exported_sample_model, sample_pngs,
                                                                                tmp_path):
    folder, images = sample_pngs
    model = sample_checkpoint / "checkpoints" / kind if kind.endswith(".ckpt") else exported_sample_model[0] / kind
    result = run_module("src.predict", f"ckpt_path={model}", f"images={folder}", "top_k=3",
                        f"json={tmp_path / 'p.json'}", f"hydra.run.dir={tmp_path}/run")
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


def test_an_undecodable_image_is_one_error_line(sample_checkpoint, tmp_path):
    (tmp_path / "notes.png").write_text("not an image")
    result = run_module("src.predict", f"ckpt_path={sample_checkpoint}/checkpoints/last.ckpt",
                        f"images={tmp_path / 'notes.png'}", f"hydra.run.dir={tmp_path}/run")
    assert result.returncode == 2 and "Traceback" not in output(result), output(result)[-3000:]
    assert output(result).strip().splitlines()[-1] == (
        f"error: {tmp_path / 'notes.png'} cannot be decoded as an image (not a PNG or JPEG file, or a damaged one): "
        "pass PNG or JPEG files")


def test_missing_files_and_empty_folders_are_refused(tmp_path):
    with pytest.raises(UserError, match=r"images=.*nope.png does not exist"):
        image_files([str(tmp_path / "nope.png")])
    with pytest.raises(UserError, match="holds no PNG or JPEG file"):
        image_files(str(tmp_path))
    with pytest.raises(UserError, match=r"ckpt_path=.*gone.onnx does not exist"):
        load_model(tmp_path / "gone.onnx", trusted=False)


def test_a_model_of_another_shape_is_refused(exported_sample_model, tmp_path):
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("Identity", ["images"], ["logits"])], "wide",
                              [helper.make_tensor_value_info("images", TensorProto.FLOAT, ["N", 3, 224, 224])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 3, 224, 224])])
    onnx.save(helper.make_model(graph), tmp_path / "wide.onnx")
    with pytest.raises(UserError, match=r"wide.onnx is a model of another shape \(input images \['N', 3, 224, 224\]\)"):
        load_model(tmp_path / "wide.onnx", trusted=False)
    out = exported_sample_model[0]
    (tmp_path / "w.safetensors").write_bytes((out / "last.safetensors").read_bytes())
    meta = json.loads((out / "last.json").read_text())
    (tmp_path / "w.json").write_text(json.dumps({**meta, "arch": "resnet34"}))  # weights of a resnet18
    with pytest.raises(UserError, match=r"w.safetensors holds a model of another shape than .*w.json describes "
                                        r"\(resnet34, stem imagenet, 10 classes"):
        load_model(tmp_path / "w.safetensors", trusted=False)


def test_dash_dash_json_is_the_json_key():
    assert json_flag(["src.predict", "--json", "images=a.png"]) == ["src.predict", "json=-", "images=a.png"]
    assert json_flag(["src.predict", "--json=out.json"]) == ["src.predict", "json=out.json"]


def test_dash_dash_json_prints_json_alone_on_stdout(sample_checkpoint, sample_pngs, tmp_path):
    folder, _ = sample_pngs
    result = run_module("src.predict", f"ckpt_path={sample_checkpoint}/checkpoints/last.ckpt",
                        f"images=[{folder / '1.png'},{folder / '2.png'}]", "top_k=1", "--json",
                        f"hydra.run.dir={tmp_path}/run")
    assert result.returncode == 0, output(result)[-3000:]
    predictions = json.loads(result.stdout)
    assert [Path(p["image"]).name for p in predictions] == ["1.png", "2.png"]
    assert all(len(p["top"]) == 1 and 0 < p["top"][0]["probability"] <= 1 for p in predictions)
