"""The LightningModule: a ResNet, cross-entropy, SGD with warm-up + decay, torchmetrics accuracy."""

from __future__ import annotations

import logging
import math
import warnings
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy

from src.core.errors import UserError, check_number, whole
from src.models.batch_size import record_in_config
from src.models.batch_size import resolve as resolve_batch_size
from src.models.fast_path import channels_last_choice, check_compile, compile_choice
from src.models.resnet import WIDTH, build_resnet

DECAYS = ("cosine", "linear", "none")
# The epoch's values logged here are torchmetrics' results, reduced across the ranks already (every rank computes
# them together): Lightning's advice to reduce them again does not apply.
warnings.filterwarnings("ignore", message=r"It is recommended to use `self.log\('(train|val|test)/.*sync_dist=True")
LR_SCALINGS = ("linear", "none")
# Linear scaling holds up to about 32x the reference batch (Goyal et al. 2017: 256 -> 8k images with warm-up); past it
# plain SGD tends to diverge, and the run says so with the rate it will use
LINEAR_SCALING_LIMIT = 32
log = logging.getLogger(__name__)


class ImageClassifier(L.LightningModule):
    """Trains a torchvision ResNet on batches of ``(images, labels)``.

    Hyperparameters are plain numbers and strings, so checkpoints load with ``weights_only=True``.
    """

    def __init__(
        self,
        arch: str = "resnet50",
        num_classes: int = 10,
        stem: str = "cifar",
        width: int = WIDTH,
        label_smoothing: float = 0.0,
        optimizer: dict[str, Any] | None = None,
        scheduler: dict[str, Any] | None = None,
        channels_last: bool | str = "auto",
        compile: bool | str = "auto",
    ) -> None:
        super().__init__()
        optimizer = {
            "lr": 0.1,
            "momentum": 0.9,
            "nesterov": True,
            "weight_decay": 5e-4,
            "decay_norm_and_bias": False,
            "lr_scaling": "linear",
            "reference_batch_size": 128,
            "fused": "auto",
            **(optimizer or {}),
        }
        scheduler = {
            "warmup_epochs": 1.0,
            "warmup_start_factor": 0.1,
            "decay": "cosine",
            "min_lr_factor": 0.0,
            **(scheduler or {}),
        }
        if scheduler["decay"] not in DECAYS:
            raise UserError(
                f"model.scheduler.decay={scheduler['decay']} is not known: choose one of {', '.join(DECAYS)}"
            )
        check_number("model.label_smoothing", label_smoothing, lambda v: 0.0 <= v < 1.0, "in [0, 1)")
        check_number(
            "model.num_classes", num_classes, whole(2), "a whole number >= 2 (it follows data.num_classes, the data's)"
        )
        if optimizer["lr_scaling"] not in LR_SCALINGS:
            raise UserError(
                f"model.optimizer.lr_scaling={optimizer['lr_scaling']} is not known: "
                f"choose one of {', '.join(LR_SCALINGS)}"
            )
        if channels_last not in (True, False, "auto"):
            raise UserError(f"model.channels_last={channels_last} must be true, false or auto")
        check_compile(compile)
        if optimizer["fused"] not in (True, False, "auto"):
            raise UserError(f"model.optimizer.fused={optimizer['fused']} must be true, false or auto")
        check_recipe(optimizer, scheduler)
        self.save_hyperparameters(
            {
                "arch": arch,
                "num_classes": num_classes,
                "stem": stem,
                "width": width,
                "label_smoothing": label_smoothing,
                "optimizer": optimizer,
                "scheduler": scheduler,
                "channels_last": channels_last,
                "compile": compile,
            },
            logger=False,  # train.py logs the whole resolved config instead
        )
        self.net = build_resnet(arch, num_classes, stem, width)
        self.criterion = nn.CrossEntropyLoss(label_smoothing=label_smoothing)
        # torchmetrics keeps sums and counts, so epoch values are exact across ranks and uneven batches. No update may
        # read a value back from the GPU (the host would wait for the device every step): no argument validation, no
        # NaN check (a NaN loss shows in the logged loss all the same), and weights that are device tensors already.
        self.train_acc, self.val_acc, self.test_acc = (
            MulticlassAccuracy(num_classes, average="micro", validate_args=False) for _ in range(3)
        )
        self.train_loss, self.val_loss, self.test_loss = (MeanMetric(nan_strategy="disable") for _ in range(3))
        # Evaluation losses summed in float64: the same mean to 1e-6 whatever the world size's order of additions
        for metric in (self.val_loss, self.test_loss):
            metric.set_dtype(torch.float64)
        self.memory_format = torch.contiguous_format
        # what model.compile became (src/models/fast_path.py's compile_choice): a torch.compile mode, or None (eager)
        self.compile_mode: str | None = None
        self.compile_why = ""
        self.cuda_graphs = False  # the compiled network replays CUDA graphs: its outputs live until the next replay

    def setup(self, stage: str) -> None:
        channels_last = self.hparams.channels_last
        if channels_last == "auto":  # what runs faster on the device found: src/models/fast_path.py
            channels_last = channels_last_choice(self.trainer.strategy.root_device.type)[0]
        if self.trainer.strategy.root_device.type == "mps":  # no float64 there
            for metric in (self.val_loss, self.test_loss):
                metric.set_dtype(torch.float32)
        if channels_last:
            self.memory_format = torch.channels_last
            self.net.to(memory_format=self.memory_format)
        datamodule = self.trainer.datamodule
        resolve_batch_size(self.trainer, self, datamodule)  # data.batch_size=auto: probe now, on the run's device
        if getattr(datamodule, "batch_size_why", None) and self.trainer.is_global_zero:  # what auto became
            record_in_config(self.trainer.default_root_dir, datamodule.batch_size)
        if not self.compile_why:  # decided once per process: a test after fit keeps fit's choice and its graphs
            device = self.trainer.strategy.root_device.type
            steps = None
            if stage == "fit" and self.hparams.compile == "auto" and device == "cuda":
                steps = self.trainer.estimated_stepping_batches  # loads the training batches (once, as fit would)
            self.compile_mode, self.compile_why = compile_choice(
                self.hparams.compile, device, steps, torch.are_deterministic_algorithms_enabled()
            )  # Lightning sets it for trainer.deterministic
            if self.compile_mode is not None:
                # in place: the state dict keeps its keys, so checkpoints stay interchangeable
                self.net.compile(mode=self.compile_mode)
                self.cuda_graphs = device == "cuda" and self.compile_mode in ("reduce-overhead", "max-autotune")
        # one image of the data's shape for Lightning's model summary, which then counts the network's FLOPs and shows
        # each layer's input and output sizes (without it: a FLOPs column of zeros, "Total FLOPs: 0"); one forward of
        # it at the fit's start, in eval mode without gradients, in each rank (rank zero prints the summary). Not for a
        # compiled network: it would compile a graph for it.
        shape = getattr(datamodule, "image_shape", None)
        self.example_input_array = torch.zeros(1, *shape) if shape and self.compile_mode is None else None
        if self.compile_mode is not None:
            # Lightning tests under inference_mode but validates under no_grad within fit; the two differ in what the
            # compiled graph is guarded on, so a test after fit would compile the network once more
            self.trainer.test_loop.inference_mode = self.trainer.validate_loop.inference_mode = False

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.net(images.contiguous(memory_format=self.memory_format))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        images, labels = batch
        if self.cuda_graphs:  # a new step: the previous step's graph outputs are no longer read
            torch.compiler.cudagraph_mark_step_begin()
        logits = self(images)
        loss = self.criterion(logits, labels)
        # The epoch's values accumulate in torchmetrics states, exact across ranks and uneven batches, and are reduced
        # once, at the epoch's end (on_train_epoch_end); per step, this rank's values, plain tensors, no sync.
        self.train_acc.update(logits, labels)
        self.train_loss.update(
            loss.detach().expand(len(labels))
        )  # one value per image: the epoch mean weighs each once
        # Logged at the steps whose values reach the loggers (every trainer.log_every_n_steps), and at the epoch's
        # last (for callbacks that monitor them at its end), not at every step: each self.log costs the host about a
        # millisecond of Lightning's bookkeeping (a torchmetrics object logged costs more: Lightning moves it to the
        # device each time), more than the rest of the project's loop, where a GPU step at batch 512 takes a few tens
        # of ms. Not prog_bar=True: Lightning turns progress-bar values into numbers after every batch, a wait for
        # the GPU; the bar reads train/loss at log steps (src/callbacks/progress.py).
        if self.trainer._logger_connector.should_update_logs or batch_idx + 1 >= self.trainer.num_training_batches:
            self.log("train/loss", loss)
            self.log("train/acc", (logits.argmax(dim=1) == labels).float().mean())
        return loss

    def on_train_epoch_end(self) -> None:
        self._log_epoch("train", self.train_loss, self.train_acc, suffix="_epoch")

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._evaluate(batch, self.val_loss, self.val_acc)

    def on_validation_epoch_end(self) -> None:
        self._log_epoch("val", self.val_loss, self.val_acc, prog_bar=True)

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._evaluate(batch, self.test_loss, self.test_acc)

    def on_test_epoch_end(self) -> None:
        self._log_epoch("test", self.test_loss, self.test_acc, prog_bar=True)

    def _evaluate(
        self, batch: tuple[torch.Tensor, torch.Tensor], loss_metric: MeanMetric, acc_metric: MulticlassAccuracy
    ) -> None:
        images, labels = batch
        if self.cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()
        logits = self(self._full_batch(images))[: len(labels)]
        # Plain cross-entropy, so evaluation loss compares across label-smoothing settings; per image, so the mean is
        # exact whatever the batches.
        loss_metric.update(F.cross_entropy(logits, labels, reduction="none"))
        acc_metric.update(logits, labels)

    def _log_epoch(
        self,
        stage: str,
        loss_metric: MeanMetric,
        acc_metric: MulticlassAccuracy,
        suffix: str = "",
        prog_bar: bool = False,
    ) -> None:
        """Log ``stage``'s loss and accuracy over the epoch, reduced across ranks (torchmetrics' compute: every rank
        calls this), then start the next epoch's from zero."""
        if not acc_metric.update_called:  # an epoch without a batch (trainer.limit_val_batches=0, ...)
            return
        self.log(f"{stage}/loss{suffix}", loss_metric.compute(), prog_bar=prog_bar)
        self.log(f"{stage}/acc{suffix}", acc_metric.compute(), prog_bar=prog_bar)
        if stage == "test":  # the images the ranks tested together: each once, whatever the world size
            with loss_metric.sync_context():
                self.log("test/images", loss_metric.weight.clone())
        loss_metric.reset()
        acc_metric.reset()

    def _full_batch(self, images: torch.Tensor) -> torch.Tensor:
        """A compiled network's graph is built for the full batch: the last, smaller batch of an evaluation (5,000
        images in batches of 128 leave 8) is padded with blank images up to it rather than compiled again. In eval
        mode BatchNorm uses its running statistics, so the padding changes no other image's output."""
        full = getattr(self.trainer.datamodule, "batch_size", None) if self._trainer is not None else None
        if self.compile_mode is None or full is None or len(images) >= full:
            return images
        return torch.cat([images, images.new_zeros((full - len(images), *images.shape[1:]))])

    def configure_optimizers(self) -> dict[str, Any]:
        opt = self.hparams.optimizer
        fused = opt.get("fused", "auto")
        if fused == "auto":  # one kernel launch for the whole update, where the host is what a step waits for;
            # not where Lightning's gradient scaler must unscale before clipping (fp16: 16-mixed), which it refuses
            fused = self.trainer.strategy.root_device.type == "cuda" and not (
                self.trainer.gradient_clip_val and str(self.trainer.precision).startswith("16")
            )
        optimizer = torch.optim.SGD(
            self.parameter_groups(),
            lr=self.learning_rate(),
            momentum=opt["momentum"],
            nesterov=opt["nesterov"],
            weight_decay=opt["weight_decay"],
            fused=fused or None,
        )
        total_steps = self.trainer.estimated_stepping_batches
        if self.trainer.train_dataloader is None:  # a run counted in steps (max_epochs=null): the estimate loaded none
            self.trainer.fit_loop.setup_data()
        per_epoch = max(1, math.ceil(self.trainer.num_training_batches / self.trainer.accumulate_grad_batches))
        warmup_steps = round(self.hparams.scheduler["warmup_epochs"] * per_epoch)
        if math.isfinite(total_steps):  # a fit shorter than twice the warm-up still ends decayed: half of it warms up
            warmup_steps = min(warmup_steps, int(total_steps) // 2)
        schedule = warmup_then_decay(
            warmup_steps=warmup_steps,
            total_steps=total_steps,
            start_factor=self.hparams.scheduler["warmup_start_factor"],
            decay=self.hparams.scheduler["decay"],
            min_factor=self.hparams.scheduler["min_lr_factor"],
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def parameter_groups(self) -> list[dict[str, Any]]:
        """Weight decay on conv and linear weights only: decaying BatchNorm scales and biases only hurts."""
        if self.hparams.optimizer["decay_norm_and_bias"]:
            return [{"params": list(self.parameters())}]
        params = list(self.parameters())
        return [
            {"params": [p for p in params if p.ndim > 1]},
            {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0},
        ]

    def learning_rate(self) -> float:
        """``optimizer.lr`` is the rate for ``reference_batch_size``; linear scaling keeps the per-image step the
        same when the global batch grows with devices and nodes (Goyal et al. 2017), the warm-up taking the shock."""
        opt = self.hparams.optimizer
        per_device = getattr(self.trainer.datamodule, "batch_size", None)
        if per_device is None:  # no datamodule to say the batch size: take the rate as given
            return opt["lr"]
        global_batch = per_device * self.trainer.world_size * self.trainer.accumulate_grad_batches
        warning = extreme_lr_warning(opt, global_batch)
        if warning is not None and self.trainer.is_global_zero:
            log.warning(warning)
        return scaled_lr(opt["lr"], opt["lr_scaling"], global_batch, opt["reference_batch_size"])

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Every rank builds this dict; only rank zero's reaches the disk, which the tests check. world size and
        # per-process batch: a run resumed at another world size keeps the global batch (src/launch/torchrun.py)
        checkpoint["saved_by"] = {
            "global_rank": self.global_rank,
            "world_size": self.trainer.world_size,
            "batch_size": getattr(self.trainer.datamodule, "batch_size", None),
            "accumulate": self.trainer.accumulate_grad_batches,
        }


# The recipe's numbers, each a one-line UserError where it is out of range: torch.optim.SGD refuses some only once the
# ranks run, with a ValueError naming no key (lr=-0.1), and takes others to diverge or to end above the peak rate
RECIPE_RANGES = (
    ("optimizer", "lr", lambda v: v >= 0, "a number >= 0"),
    ("optimizer", "momentum", lambda v: 0 <= v < 1, "in [0, 1): at 1 or more the steps grow without bound"),
    ("optimizer", "weight_decay", lambda v: v >= 0, "a number >= 0"),
    ("optimizer", "reference_batch_size", whole(1), "a whole number >= 1"),
    ("scheduler", "warmup_epochs", lambda v: v >= 0, "a number >= 0 (0: no warm-up)"),
    ("scheduler", "warmup_start_factor", lambda v: 0 <= v <= 1, "in [0, 1]: the warm-up's first rate x lr"),
    ("scheduler", "min_lr_factor", lambda v: 0 <= v <= 1, "in [0, 1]: the decay's last rate x lr"),
)


def check_recipe(optimizer: dict[str, Any], scheduler: dict[str, Any]) -> None:
    """Refuse a value of ``model.optimizer`` or ``model.scheduler`` out of its range, naming the key."""
    groups = {"optimizer": optimizer, "scheduler": scheduler}
    for group, key, within, words in RECIPE_RANGES:
        check_number(f"model.{group}.{key}", groups[group][key], within, words)
    if optimizer["nesterov"] and optimizer["momentum"] == 0:
        raise UserError(
            "model.optimizer.nesterov=true needs model.optimizer.momentum > 0: set a momentum, or nesterov=false"
        )


def extreme_lr_warning(opt: dict[str, Any], global_batch: int) -> str | None:
    """The warning for a rate linear scaling takes past ``LINEAR_SCALING_LIMIT`` x the reference batch's (``opt``:
    the model's optimizer settings), or None."""
    lr, reference_batch = opt["lr"], opt["reference_batch_size"]
    if opt["lr_scaling"] != "linear" or global_batch <= LINEAR_SCALING_LIMIT * reference_batch:
        return None
    peak = scaled_lr(lr, "linear", global_batch, reference_batch)
    return (
        f"linear lr scaling gives a peak lr of {peak:.4g} (model.optimizer.lr={lr:g} x global batch "
        f"{global_batch} / reference_batch_size {reference_batch}), {global_batch / reference_batch:.0f}x the "
        f"reference; past {LINEAR_SCALING_LIMIT}x, SGD tends to diverge: consider a lower model.optimizer.lr, "
        "model.optimizer.lr_scaling=none, a longer model.scheduler.warmup_epochs, or a smaller data.batch_size"
    )


def scaled_lr(lr: float, scaling: str, global_batch: int, reference_batch: int) -> float:
    """The learning rate for ``global_batch`` images per step, given ``lr`` for ``reference_batch``."""
    return lr * global_batch / reference_batch if scaling == "linear" else lr


def warmup_then_decay(
    warmup_steps: int, total_steps: float, start_factor: float = 0.1, decay: str = "cosine", min_factor: float = 0.0
):
    """LR multiplier per optimizer step: linear warm-up from ``start_factor`` to 1, then cosine/linear decay."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return start_factor + (1.0 - start_factor) * step / warmup_steps
        if decay == "none" or not math.isfinite(total_steps):  # open-ended runs keep the peak rate
            return 1.0
        progress = min(1.0, (step - warmup_steps) / max(1.0, total_steps - warmup_steps))
        shape = 0.5 * (1.0 + math.cos(math.pi * progress)) if decay == "cosine" else 1.0 - progress
        return min_factor + (1.0 - min_factor) * shape

    return factor
