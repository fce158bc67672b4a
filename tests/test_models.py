"""The ResNets are torchvision's, with the CIFAR stem; the module trains them with SGD and a warm-up schedule."""

from __future__ import annotations

import io
import re
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
from torch import nn
from torchvision import models

from src.core.errors import UserError
from src.data.synthetic import SyntheticDataModule
from src.models.classifier import ImageClassifier, check_recipe, scaled_lr, warmup_then_decay
from src.models.fast_path import fast_path
from src.models.resnet import NarrowResNet, build_resnet, resnet_names

# torchvision's ResNet-50 has 25,557,032 parameters for 1,000 classes; with a 10-class head that is
# 23,528,522, and the 3x3 CIFAR stem (1,728 weights instead of 9,408) makes it 23,520,842.
RESNET50_CIFAR_PARAMS = 23_520_842
RESNET50_STOCK_10_CLASS_PARAMS = 23_528_522


def count(net: nn.Module) -> int:
    return sum(p.numel() for p in net.parameters())


def test_resnet50_cifar_stem_keeps_32x32_into_layer1_and_outputs_10_logits():
    net = build_resnet("resnet50", num_classes=10, stem="cifar").eval()
    assert (net.conv1.kernel_size, net.conv1.stride) == ((3, 3), (1, 1))
    assert isinstance(net.maxpool, nn.Identity)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        stem = net.maxpool(net.relu(net.bn1(net.conv1(x))))
        assert stem.shape == (2, 64, 32, 32)
        assert net.layer4(net.layer3(net.layer2(net.layer1(stem)))).shape == (2, 2048, 4, 4)
        assert net(x).shape == (2, 10)
    assert count(net) == RESNET50_CIFAR_PARAMS


def test_stock_stem_is_torchvisions_7x7_stride_2_with_max_pool():
    net = build_resnet("resnet50", num_classes=10, stem="imagenet")
    assert (net.conv1.kernel_size, net.conv1.stride) == ((7, 7), (2, 2))
    assert isinstance(net.maxpool, nn.MaxPool2d)
    assert count(net) == RESNET50_STOCK_10_CLASS_PARAMS


def test_other_torchvision_resnets_are_selectable_by_name():
    assert {"resnet18", "resnet34", "resnet50", "resnet101", "resnet152", "wide_resnet50_2"} <= set(resnet_names())
    assert build_resnet("resnet18")(torch.randn(1, 3, 32, 32)).shape == (1, 10)


@pytest.mark.parametrize("arch", ["resnet18", "resnet50", "resnext50_32x4d"])
def test_a_narrow_resnet_is_torchvisions_blocks_at_a_fraction_of_the_width(arch):
    full = build_resnet(arch, num_classes=10, stem="cifar")
    same = NarrowResNet(type(full.layer1[0]), [2, 2, 2, 2] if arch == "resnet18" else [3, 4, 6, 3], 64,
                        num_classes=10, groups=full.groups, width_per_group=full.base_width)  # fmt: skip
    # at 64, the class is torchvision's network: the same names and shapes
    assert {k: v.shape for k, v in same.state_dict().items()} == {
        k: v.shape for k, v in models.get_model(arch, num_classes=10).state_dict().items()
    }
    narrow = build_resnet(arch, num_classes=10, stem="cifar", width=16).eval()
    assert isinstance(narrow, NarrowResNet) and len(list(narrow.modules())) == len(list(full.modules()))
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        stem = narrow.maxpool(narrow.relu(narrow.bn1(narrow.conv1(x))))
        assert stem.shape == (2, 16, 32, 32)  # the CIFAR stem at the narrow width too
        assert narrow(x).shape == (2, 10)
    # every conv and BatchNorm a quarter of the channels: about a sixteenth of the parameters
    assert 1 / 20 < count(narrow) / count(full) < 1 / 12
    assert narrow.fc.in_features == full.fc.in_features // 4


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"arch": "vgg16"}, "model.arch=vgg16"),
        ({"stem": "huge"}, "model.stem=huge"),
        ({"width": 0}, "model.width=0 is not a width this project builds: an integer from 1 to 64"),
        ({"width": 128}, "model.width=128 is not"),
        ({"width": "16"}, "model.width=16 is not"),
        ({"arch": "resnext50_32x4d", "width": 8}, "model.width=8 is too narrow for resnext50_32x4d.*take 16 or more"),
    ],
)
def test_unknown_arch_stem_or_width_is_a_user_error_naming_the_key(kwargs, words):
    with pytest.raises(UserError, match=words):
        build_resnet(**kwargs)


def test_schedule_warms_up_linearly_then_decays_to_the_floor():
    f = warmup_then_decay(warmup_steps=10, total_steps=110, start_factor=0.1, decay="cosine", min_factor=0.01)
    assert f(0) == pytest.approx(0.1) and f(5) == pytest.approx(0.55) and f(10) == pytest.approx(1.0)
    assert f(60) == pytest.approx(0.01 + 0.99 * 0.5)
    assert f(110) == pytest.approx(0.01)
    values = [f(s) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(values, values[1:]))
    linear = warmup_then_decay(0, 100, decay="linear")
    assert linear(50) == pytest.approx(0.5)
    assert warmup_then_decay(0, float("inf"))(10**6) == 1.0  # open-ended runs keep the peak rate


@pytest.mark.parametrize(
    "group, key, bad",
    [
        ("optimizer", "lr", -0.1),  # torch's ValueError named a scaled rate and no key, once the ranks ran
        ("optimizer", "lr", float("nan")),
        ("optimizer", "momentum", 1.0),  # taken by torch: the steps grow without bound
        ("optimizer", "momentum", -0.5),
        ("optimizer", "weight_decay", -1),
        ("optimizer", "reference_batch_size", 0),  # a ZeroDivisionError
        ("optimizer", "reference_batch_size", 12.5),
        ("scheduler", "warmup_epochs", -1),  # taken: a schedule from the middle of its decay
        ("scheduler", "warmup_start_factor", 1.5),
        ("scheduler", "min_lr_factor", 2),  # taken: a rate that rose above the peak as it "decayed"
        ("scheduler", "min_lr_factor", "low"),
    ],
)
def test_a_recipe_value_out_of_range_is_refused_naming_its_key(group, key, bad):
    model = ImageClassifier(arch="resnet18")
    recipe = {"optimizer": dict(model.hparams.optimizer), "scheduler": dict(model.hparams.scheduler)}
    check_recipe(**recipe)  # the defaults pass
    recipe[group][key] = bad
    with pytest.raises(UserError, match=rf"^model\.{group}\.{key}={bad} must be"):
        check_recipe(**recipe)


def test_nesterov_without_momentum_is_refused_and_plain_sgd_is_not():
    with pytest.raises(UserError, match="nesterov=true needs model.optimizer.momentum > 0"):
        ImageClassifier(arch="resnet18", optimizer={"momentum": 0.0})
    ImageClassifier(arch="resnet18", optimizer={"momentum": 0.0, "nesterov": False})


def test_label_smoothing_and_sgd_settings_come_from_config():
    model = ImageClassifier(
        arch="resnet18",
        label_smoothing=0.1,
        optimizer={"lr": 0.2, "momentum": 0.8, "nesterov": False, "weight_decay": 1e-4},
    )
    assert model.criterion.label_smoothing == 0.1
    assert model.hparams.optimizer == {
        "lr": 0.2,
        "momentum": 0.8,
        "nesterov": False,
        "weight_decay": 1e-4,
        "decay_norm_and_bias": False,
        "lr_scaling": "linear",
        "reference_batch_size": 128,
        "fused": "auto",
    }
    with pytest.raises(UserError, match="model.label_smoothing"):
        ImageClassifier(arch="resnet18", label_smoothing=1.5)


def fit(model: ImageClassifier, datamodule, **trainer_kwargs) -> L.Trainer:
    trainer = L.Trainer(
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **trainer_kwargs,
    )
    trainer.fit(model, datamodule)
    return trainer


def test_resnet50_itself_trains_a_few_steps_and_steps_the_learning_rate():
    L.seed_everything(0)
    model = ImageClassifier(arch="resnet50", scheduler={"warmup_epochs": 1.0})
    before = model.net.fc.weight.detach().clone()
    data = SyntheticDataModule(num_train=12, num_test=4, batch_size=4, val_size=4)
    used: list[float] = []

    class Record(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            used.append(trainer.optimizers[0].param_groups[0]["lr"])

    trainer = fit(model, data, max_epochs=1, limit_val_batches=1, callbacks=[Record()])
    assert trainer.global_step == 2
    assert not torch.equal(before, model.net.fc.weight)
    assert torch.isfinite(trainer.callback_metrics["train/loss"])
    # a warm-up of one epoch in a fit of one takes half of it (the first step, at 0.1 x lr); the peak rate, scaled
    # to the batch of 4 (reference 128), then decays to 0 at the fit's end
    peak = 0.1 * 4 / 128
    assert used == pytest.approx([0.1 * peak, peak])
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.0)


def test_a_fit_counted_in_steps_warms_up_and_decays_over_those_steps():
    """trainer.max_epochs=null with max_steps: Lightning's estimate of the steps loads no training batches then, and
    the schedule's steps per epoch read an infinite count (OverflowError before the first step)."""
    model = ImageClassifier(arch="resnet18", stem="imagenet", width=16, scheduler={"warmup_epochs": 1.0})
    data = SyntheticDataModule(num_train=12, num_test=4, batch_size=4, val_size=4)  # 2 steps an epoch
    used: list[float] = []

    class Record(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            used.append(trainer.optimizers[0].param_groups[0]["lr"])

    trainer = fit(model, data, max_epochs=None, max_steps=5, limit_val_batches=1, callbacks=[Record()])
    assert trainer.global_step == 5 and trainer.current_epoch == 3
    peak = 0.1 * 4 / 128  # a warm-up of one epoch (2 steps) from 0.1 x the peak, then down to 0 at step 5
    assert used[:3] == pytest.approx([0.1 * peak, 0.55 * peak, peak]) and used[3] < peak
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.0)


def test_the_progress_bar_ends_an_epoch_that_max_steps_cuts_short_at_its_last_step():
    """The bar draws at most every min_interval_s (src/callbacks/progress.py); an epoch that trainer.max_steps ended
    between drawings ended on the count drawn before (1/11 after 3 steps)."""
    from src.callbacks.progress import ProgressBar

    console = io.StringIO()
    model = ImageClassifier(arch="resnet18", stem="imagenet", width=16)
    data = SyntheticDataModule(num_train=48, num_test=4, batch_size=4, val_size=4)  # 11 steps an epoch
    trainer = L.Trainer(
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        max_epochs=30,  # as the project's config: the bar counts an epoch's batches, not max_steps
        max_steps=3,
        callbacks=[ProgressBar(min_interval_s=3600, console_kwargs={"file": console, "width": 100})],
    )
    trainer.fit(model, data)
    assert trainer.global_step == 3
    assert re.search(r"Epoch 0/29 .* 3/11 ", console.getvalue()), console.getvalue()


def test_the_model_summary_counts_one_images_flops_and_its_image_moves_no_resume_position(tmp_path):
    """Before, Lightning's summary had no example input: a FLOPs column of zeros and "Total FLOPs: 0". Its example
    image goes through the datamodule's batch hook at the fit's start, where a training batch moves the place in the
    epoch a checkpoint resumes from: the image must not."""
    from lightning.pytorch.callbacks import ModelCheckpoint, ModelSummary
    from torch.utils.flop_counter import FlopCounterMode

    from src.core.console import quiet_resume

    counted = []

    class Summary(ModelSummary):
        @staticmethod
        def summarize(summary_data, total_parameters, trainable_parameters, model_size, modes, total_flops, **kw):
            counted.append(total_flops)

    def fit_to(max_steps: int, ckpt_path: Path | None = None) -> SyntheticDataModule:
        model = ImageClassifier(arch="resnet18", stem="imagenet", width=16)
        data = SyntheticDataModule(num_train=48, num_test=4, batch_size=4, val_size=4)  # 11 steps an epoch
        at_step_2 = ModelCheckpoint(
            tmp_path, "step{step}", every_n_train_steps=2, save_top_k=-1, auto_insert_metric_name=False
        )
        trainer = L.Trainer(
            accelerator="cpu",
            logger=False,
            enable_progress_bar=False,
            num_sanity_val_steps=0,
            max_epochs=1,
            max_steps=max_steps,
            callbacks=[Summary(), at_step_2],
        )
        with warnings.catch_warnings():
            quiet_resume(ckpt_path and str(ckpt_path), resumable_position=True)  # the project's, as src.train's
            trainer.fit(model, data, ckpt_path=ckpt_path, weights_only=True)
        return data

    assert fit_to(3).state_dict()["train_position"]["consumed"] == 3
    with FlopCounterMode(display=False) as flops:
        build_resnet("resnet18", 10, "imagenet", 16).eval()(torch.zeros(1, 3, 32, 32))
    assert counted == [flops.get_total_flops()] and counted[0] > 0
    # resumed mid-epoch, the summary's image comes after the place is restored: one more step is the third batch
    assert fit_to(3, tmp_path / "step2.ckpt").state_dict()["train_position"]["consumed"] == 3


def test_loss_falls_on_synthetic_data():
    L.seed_everything(0)
    # the ImageNet stem at 32 px (a sixteenth of the CIFAR stem's work) on the tests' narrow network: the loss falls to
    # about 8% of the first epoch's in 0.5 s (torchvision's ResNet-18 there: 7%, in 2.4 s; 9 s beside the suite)
    model = ImageClassifier(
        arch="resnet18",
        stem="imagenet",
        width=16,
        optimizer={"lr": 0.02, "lr_scaling": "none"},
        scheduler={"warmup_epochs": 0.5},
    )
    data = SyntheticDataModule(num_train=480, num_test=64, image_size=32, batch_size=32)
    losses: dict[int, list[float]] = {}

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.setdefault(trainer.current_epoch, []).append(float(outputs["loss"]))

    fit(model, data, max_epochs=3, callbacks=[Record()])
    first, last = (sum(v) / len(v) for v in (losses[0], losses[2]))
    assert last < 0.5 * first, losses


def test_weight_decay_skips_batchnorm_and_biases_unless_asked():
    model = ImageClassifier(arch="resnet18")
    decayed, plain = model.parameter_groups()
    assert plain["weight_decay"] == 0.0 and "weight_decay" not in decayed  # the optimizer's value applies
    bn_and_bias = {
        id(p)
        for m in model.modules()
        if isinstance(m, (nn.BatchNorm2d, nn.Linear))
        for name, p in m.named_parameters()
        if isinstance(m, nn.BatchNorm2d) or name == "bias"
    }
    assert {id(p) for p in plain["params"]} == bn_and_bias
    assert len(decayed["params"]) + len(plain["params"]) == len(list(model.parameters()))
    everything = ImageClassifier(arch="resnet18", optimizer={"decay_norm_and_bias": True}).parameter_groups()
    assert len(everything) == 1


def test_learning_rate_scales_linearly_with_the_global_batch():
    assert scaled_lr(0.1, "linear", global_batch=1024, reference_batch=128) == pytest.approx(0.8)
    assert scaled_lr(0.1, "linear", global_batch=64, reference_batch=128) == pytest.approx(0.05)
    assert scaled_lr(0.1, "none", global_batch=1024, reference_batch=128) == 0.1
    with pytest.raises(UserError, match="model.optimizer.lr_scaling"):
        ImageClassifier(arch="resnet18", optimizer={"lr_scaling": "sqrt"})


def test_channels_last_and_compile_are_switches(tmp_path):
    model = ImageClassifier(arch="resnet18", channels_last=True, compile=True)
    trainer = L.Trainer(accelerator="cpu", logger=False, default_root_dir=tmp_path)
    trainer.strategy.connect(model)
    model.trainer = trainer
    model.setup("fit")
    assert model.net.conv1.weight.is_contiguous(memory_format=torch.channels_last)
    assert model.net._compiled_call_impl is not None  # compiled lazily, at the first forward
    plain = ImageClassifier(arch="resnet18", channels_last=False)
    plain.trainer = trainer
    plain.setup("fit")
    assert plain.memory_format == torch.contiguous_format and plain.net._compiled_call_impl is None
    auto = ImageClassifier(arch="resnet18")  # auto: what src/models/fast_path.py found faster on this CPU
    auto.trainer = trainer
    auto.setup("fit")
    expected = torch.channels_last if fast_path("cpu", "resnet18").channels_last else torch.contiguous_format
    assert auto.memory_format == expected and auto.net.conv1.weight.is_contiguous(memory_format=expected)
    with pytest.raises(UserError, match="model.channels_last"):
        ImageClassifier(arch="resnet18", channels_last="yes")
