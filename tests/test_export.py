"""`python -m src.export`: ONNX and safetensors files that onnxruntime and plain torchvision run as the checkpoint."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from src.core.errors import UserError
from src.models.classifier import ImageClassifier
from src.serving.exporter import chosen_formats, export_safetensors
from src.serving.formats import Normalised, load_classifier, safetensors_model
from tests.conftest import ROOT, output, run_module

BOUNDS = {"min_top1_agreement": 0.999, "max_abs_logit_diff": 1e-3}


def test_a_trained_checkpoint_exports_to_onnx_and_safetensors_that_agree_with_pytorch_on_the_samples_test_images(
    exported_sample_model, sample_checkpoint
):
    out, printed = exported_sample_model
    record = json.loads((out / "export.json").read_text())["last.ckpt"]
    assert record["validated_on"]["images"] == 1000  # the sample's test set: the data the run trained on
    for name in ("onnx", "safetensors"):
        figures = record[name]
        assert figures["top1_agreement"] >= 0.999 and figures["max_abs_logit_diff"] <= 1e-3, figures
        assert figures["bounds"] == BOUNDS and "failed" not in figures
        assert (out / f"last.{name}").is_file()
    assert re.search(
        r"onnx: onnxruntime \S+ vs PyTorch on 1000 images: top-1 agreement 1\.0000, max \|logit diff\| "
        r"\d\.\d\de[-+]\d\d",
        printed,
    ), printed[-3000:]
    assert "onnxscript" not in printed  # the exporter's passes keep their INFO lines to themselves
    meta = json.loads((out / "last.json").read_text())
    assert meta["arch"] == "resnet18" and meta["stem"] == "imagenet" and meta["num_classes"] == 10
    assert meta["class_names"][:3] == ["airplane", "automobile", "bird"] and len(meta["mean"]) == 3
    assert meta["checkpoint"]["step"] == 60 and 0 < meta["checkpoint"]["val_acc"] <= 1
    assert len(meta["config_sha256"]) == 64
    assert not list(out.glob(".*tmp*"))


def test_the_onnx_model_takes_any_batch_of_images_in_0_1_and_names_its_classes(
    exported_sample_model, sample_checkpoint
):
    from src.serving.formats import onnx_session

    session = onnx_session(exported_sample_model[0] / "last.onnx")
    assert [(i.name, i.shape[1:], i.type) for i in session.get_inputs()] == [("images", [3, 32, 32], "tensor(float)")]
    model, _ = load_classifier(sample_checkpoint / "checkpoints" / "last.ckpt", trusted=False)
    for batch in (1, 3):
        images = torch.rand(batch, 3, 32, 32)
        with torch.inference_mode():
            expected = Normalised(model.net).eval()(images)
        got = torch.from_numpy(session.run(None, {"images": images.numpy()})[0])
        assert got.shape == (batch, 10) and (got - expected).abs().max() <= 1e-3
    names = json.loads(session.get_modelmeta().custom_metadata_map["class_names"])
    assert names[-1] == "truck"


def documented_loader() -> str:
    """The loader docs/export.md shows, as written there."""
    page = (ROOT / "docs" / "export.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", page, re.S)
    loaders = [b for b in blocks if "load_file" in b]
    assert len(loaders) == 1, "docs/export.md shows one safetensors loader"
    return loaders[0]


@pytest.mark.parametrize("stem", ["cifar", "imagenet"])
def test_the_documented_loader_rebuilds_torchvisions_network_with_the_same_logits(stem, tmp_path, monkeypatch):
    model = ImageClassifier(arch="resnet18", stem=stem).eval()
    with torch.no_grad():  # running statistics other than the initial ones: the loader must restore them too
        for module in model.net.modules():
            if isinstance(module, torch.nn.BatchNorm2d):
                module.running_mean.uniform_(-0.5, 0.5)
                module.running_var.uniform_(0.5, 2.0)
    meta = {
        "arch": "resnet18",
        "stem": stem,
        "num_classes": 10,
        "mean": [0.4914, 0.4822, 0.4465],
        "std": [0.247, 0.2435, 0.2616],
    }
    config = OmegaConf.create({"batch_size": 4, **BOUNDS})
    export_safetensors(Normalised(model.net).eval(), tmp_path / "last.safetensors", meta, None, None, config)
    images = torch.rand(4, 3, 32, 32)
    monkeypatch.chdir(tmp_path)
    scope = {"images": images}
    exec(documented_loader(), scope)  # noqa: S102 - the page's own code, as a user would paste it
    with torch.inference_mode():
        expected = Normalised(model.net).eval()(images)
    assert (scope["logits"] - expected).abs().max() <= 1e-5


@pytest.mark.parametrize("width", [16, 64])  # the project's NarrowResNet; torchvision's own builder
@pytest.mark.parametrize("stem", ["cifar", "imagenet"])
def test_a_safetensors_of_either_width_is_rebuilt_by_src_predicts_loader_with_the_same_logits(stem, width, tmp_path):
    model = ImageClassifier(arch="resnet18", stem=stem, width=width).eval()
    meta = {"arch": "resnet18", "stem": stem, "width": width, "num_classes": 10, "class_names": list("abcdefghij")}
    images = torch.rand(4, 3, 32, 32)
    with torch.inference_mode():
        expected = Normalised(model.net).eval()(images)
    config = OmegaConf.create({"batch_size": 4, **BOUNDS})
    figures = export_safetensors(Normalised(model.net), tmp_path / "last.safetensors", meta, images, expected, config)
    assert figures["top1_agreement"] == 1.0 and "failed" not in figures  # checked against the rebuilt network
    forward, names = safetensors_model(tmp_path / "last.safetensors")
    with torch.inference_mode():
        assert (forward(images) - expected).abs().max() <= 1e-5 and names == meta["class_names"]


def test_a_failed_validation_keeps_no_file_and_says_why_in_one_line(sample_checkpoint, tmp_path):
    result = run_module(
        "src.export",
        f"ckpt_path={sample_checkpoint}/checkpoints/last.ckpt",
        "format=onnx",
        "export.max_abs_logit_diff=0",
        "export.validation_images=64",
        f"export.dir={tmp_path}",
        f"hydra.run.dir={tmp_path}/run",
    )
    text = output(result)
    assert result.returncode == 2 and "Traceback" not in text, text[-3000:]
    errors = [line for line in text.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "export.max_abs_logit_diff=0" in errors[0] and "not kept" in errors[0], text[-3000:]
    assert not (tmp_path / "last.onnx").exists() and not list(tmp_path.glob(".*tmp*"))
    figures = json.loads((tmp_path / "export.json").read_text())["last.ckpt"]["onnx"]
    assert figures["top1_agreement"] >= 0.999 and figures["max_abs_logit_diff"] > 0 and "failed" in figures


def test_without_the_export_extra_one_line_names_the_install_command(tmp_path):
    # onnxruntime made unimportable in this process only: sys.modules[name] = None is how Python marks a blocked module
    code = (
        "import runpy, sys; sys.modules['onnxruntime'] = None; sys.argv[0] = 'src.export'; "
        "runpy.run_module('src.export', run_name='__main__', alter_sys=True)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, "ckpt_path=any.ckpt", "format=onnx", f"hydra.run.dir={tmp_path}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, output(result)[-3000:]
    assert output(result).strip().splitlines()[-1] == (
        'error: format=onnx needs the onnxruntime package, which is not installed: pip install -e ".[export]" '
        "(or pip install onnxruntime)"
    )


def test_formats_are_one_name_or_several_and_an_unknown_one_is_refused():
    assert chosen_formats("onnx") == ["onnx"]
    assert chosen_formats(["safetensors", "onnx"]) == ["safetensors", "onnx"]
    assert chosen_formats("onnx,safetensors") == ["onnx", "safetensors"]
    with pytest.raises(UserError, match="format=torchscript is not known: choose one or more of onnx, safetensors"):
        chosen_formats("torchscript")


def test_an_untrusted_checkpoint_with_python_objects_is_not_unpickled(tmp_path):
    import datetime

    path = tmp_path / "odd.ckpt"
    torch.save({"hyper_parameters": {"made": datetime.date(2026, 11, 25)}, "state_dict": {}}, path)
    with pytest.raises(UserError, match="ckpt_trusted=true"):
        load_classifier(path, trusted=False)


def test_a_run_config_whose_data_would_import_something_else_is_not_used(tmp_path):
    from src.serving.formats import run_config

    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "config.yaml").write_text("data:\n  _target_: os.system\n  command: touch pwned\n")
    assert run_config(tmp_path / "checkpoints" / "last.ckpt") == (None, None)
    (tmp_path / "config.yaml").write_text("data:\n  _target_: src.data.synthetic.SyntheticDataModule\n  num_test: 8\n")
    config, found = run_config(tmp_path / "checkpoints" / "last.ckpt")
    assert found == tmp_path / "config.yaml" and config.data.num_test == 8


@pytest.mark.parametrize(
    "key, value, words",
    [
        ("batch_size", 0, "export.batch_size=0 must be a whole number >= 1"),  # before: range()'s ValueError
        ("opset", "abc", "export.opset=abc must be a whole number >= 18"),  # before: a TypeError's traceback
        ("opset", 17, "export.opset=17 must be a whole number >= 18"),  # before: written as 18, a traceback shown
        ("min_top1_agreement", 2, "export.min_top1_agreement=2 must be in [0, 1]"),  # before: found after the exports
        ("max_abs_logit_diff", -1, "export.max_abs_logit_diff=-1 must be a number >= 0"),
        ("max_abs_logit_diff", float("nan"), "export.max_abs_logit_diff=nan must be a number >= 0"),
        ("validation_images", 0, "export.validation_images=0 must be a whole number >= 1, or null"),
        ("validate", "maybe", "export.validate=maybe must be true or false"),  # before: taken as true
    ],
)
def test_export_values_no_export_can_meet_are_refused_before_any_work(key, value, words):
    from src.export import check_export_settings

    defaults = OmegaConf.load(ROOT / "conf" / "export.yaml").export
    check_export_settings(defaults)
    check_export_settings(OmegaConf.merge(defaults, {"opset": 18, "validation_images": 5, "max_abs_logit_diff": 0}))
    with pytest.raises(UserError) as refused:
        check_export_settings(OmegaConf.merge(defaults, {key: value}))
    assert str(refused.value).startswith(words)


def test_an_opset_the_exporter_does_not_write_is_one_line_not_another_opset(tmp_path):
    import onnx

    from src.serving.exporter import export_onnx

    class Tiny(torch.nn.Module):  # a ResNet's kinds of layer, which onnx's converter takes to no opset below 18
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.Sequential(
                torch.nn.Conv2d(3, 4, 3),
                torch.nn.BatchNorm2d(4),
                torch.nn.ReLU(),
                torch.nn.AdaptiveAvgPool2d(1),
                torch.nn.Flatten(),
                torch.nn.Linear(4, 10),
            )

        def forward(self, images: torch.Tensor) -> torch.Tensor:  # the input's name, as Normalised's
            return self.layers(images)

    net = Tiny().eval()
    config = OmegaConf.create({"opset": onnx.defs.onnx_opset_version() + 1, "batch_size": 4, **BOUNDS})
    with pytest.raises(UserError, match=r"export.opset=\d+ is newer than onnx \S+ knows"):
        export_onnx(net, tmp_path / "m.onnx", {}, None, None, config)
    config.opset = 17  # past the up-front check: the exporter writes 18 (its lowest) instead, which is refused
    with pytest.raises(UserError, match="torch's ONNX exporter wrote opset 18, not export.opset=17"):
        export_onnx(net, tmp_path / "m.onnx", {}, None, None, config)
    assert list(tmp_path.iterdir()) == []  # nothing kept


def test_eval_and_export_use_the_runs_data_with_the_command_lines_data_values_unless_it_chose_the_group(tmp_path):
    from src.serving.formats import data_to_test, run_config_of

    def tested(ckpt, group_given, keys):  # as src.eval and src.export ask
        return data_to_test(given, *run_config_of(ckpt), group_given, keys)

    given = OmegaConf.create({"_target_": "src.data.cifar10.CIFAR10DataModule", "root": "data", "batch_size": 64})
    (tmp_path / "checkpoints").mkdir()
    ckpt = tmp_path / "checkpoints" / "last.ckpt"
    assert tested(ckpt, False, []) == (given, "")  # no config.yaml beside it
    (tmp_path / "config.yaml").write_text(
        "data:\n  _target_: src.data.synthetic.SyntheticDataModule\n  num_test: 8\n  batch_size: 4\n"
    )
    data, name = tested(ckpt, False, [])
    assert (data.num_test, data.batch_size) == (
        8,
        4,
    ) and name == f"the run's data=synthetic ({tmp_path / 'config.yaml'})"
    # data.batch_size=64 on the command line: the run's data, at that batch size (not the command line's CIFAR-10)
    data, name = tested(ckpt, False, ["data.batch_size"])
    assert (data._target_, data.num_test, data.batch_size) == ("src.data.synthetic.SyntheticDataModule", 8, 64)
    assert name == f"the run's data=synthetic with data.batch_size=64 ({tmp_path / 'config.yaml'})"
    assert tested(ckpt, True, ["data.batch_size"]) == (given, "")  # data=cifar10: the command line's
    assert tested("s3://bucket/run/last.ckpt", False, []) == (given, "")


def test_a_full_export_dir_is_one_line_naming_the_file_and_what_was_kept(tmp_path):
    """Before: "no space left on device writing the run dir ...: there is no intact last.ckpt yet", which an export
    has neither of. A real export into a full 1,000 KB tmpfs (the ONNX file fitted, the safetensors did not) gave
    these lines. Here: an OSError from a real write to /dev/full (each write: ENOSPC; opened for writing only, never
    replaced), and safetensors' own error as save_file raised it there, whose text alone carries the OS's words."""
    from safetensors import SafetensorError

    from src.export import refusals_said

    full = Path("/dev/full")
    if not full.is_char_device():
        pytest.skip("no /dev/full here")
    with pytest.raises(
        UserError, match=r"^cannot write /dev/full \(No space left on device\): /x/last.onnx kept; free"
    ):
        with refusals_said(full, ["/x/last.onnx"], tmp_path):
            with open(full, "wb") as f:
                f.write(bytes(1 << 16))
    target = tmp_path / "last.safetensors"
    with pytest.raises(UserError) as refused:
        with refusals_said(target, [], tmp_path):
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
    assert str(refused.value) == (
        f"cannot write {target} (No space left on device): no file kept; free space in {tmp_path}, or pass another "
        "export.dir"
    )
    with pytest.raises(ZeroDivisionError):  # anything else is raised as it is
        with refusals_said(tmp_path / "x", [], tmp_path):
            print(1 / 0)
    assert full.is_char_device()
