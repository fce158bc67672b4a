"""The datamodules: CIFAR-10 batches read, verified and split; synthetic images learnable; clear errors."""

from __future__ import annotations

import logging
import pickle

import numpy as np
import pytest
import torch

from src.data.cifar10 import CIFAR10DataModule, read_batch
from src.data.in_memory import CIFAR10_MEAN, CIFAR10_STD
from src.data.synthetic import SyntheticDataModule
from src.errors import UserError


def test_generated_cifar_folder_loads_with_a_seeded_disjoint_split(cifar_root, caplog):
    dm = CIFAR10DataModule(root=str(cifar_root), download=False, val_size=0.2, batch_size=8, seed=3)
    with caplog.at_level(logging.WARNING):
        dm.prepare_data()
    dm.setup("fit")
    assert (len(dm.train_set), len(dm.val_set), len(dm.test_set)) == (80, 20, 20)
    again = CIFAR10DataModule(root=str(cifar_root), download=False, val_size=0.2, seed=3)
    again.setup("fit")
    assert torch.equal(again.val_set.images, dm.val_set.images)  # same seed, same split
    other = CIFAR10DataModule(root=str(cifar_root), download=False, val_size=0.2, seed=4)
    other.setup("fit")
    assert not torch.equal(other.val_set.images, dm.val_set.images)
    # disjoint: no image is both in train and val (the generated images are distinct random arrays)
    train_rows = {bytes(x.numpy()) for x in dm.train_set.images}
    assert not any(bytes(x.numpy()) in train_rows for x in dm.val_set.images)
    images, labels = next(iter(dm.train_dataloader()))
    assert images.shape == (8, 3, 32, 32) and images.dtype == torch.float32 and labels.dtype == torch.int64


def test_a_folder_that_is_not_the_release_loads_with_a_one_line_warning(cifar_root, caplog):
    with caplog.at_level(logging.WARNING):
        CIFAR10DataModule(root=str(cifar_root), download=False).prepare_data()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "\n" not in warnings[0]
    assert "not the canonical release" in warnings[0] and "data_batch_1" in warnings[0]


def test_a_truncated_batch_file_is_an_error_naming_the_file(cifar_root):
    path = cifar_root / "cifar-10-batches-py" / "data_batch_3"
    path.write_bytes(path.read_bytes()[:1000])
    dm = CIFAR10DataModule(root=str(cifar_root), download=False)
    with pytest.raises(UserError, match=r"data_batch_3 is truncated or corrupt"):
        dm.setup("fit")


def test_a_batch_file_that_would_run_code_is_refused(cifar_root):
    path = cifar_root / "cifar-10-batches-py" / "test_batch"
    path.write_bytes(pickle.dumps({"data": __import__("os").system}))  # a pickle that imports os.system
    with pytest.raises(UserError, match="test_batch is truncated or corrupt.*unexpected object"):
        read_batch(path)


def test_a_missing_batch_file_is_named(cifar_root):
    (cifar_root / "cifar-10-batches-py" / "data_batch_5").unlink()
    with pytest.raises(UserError, match="lacks data_batch_5"):
        CIFAR10DataModule(root=str(cifar_root), download=False).prepare_data()


def test_missing_data_without_download_names_data_root(tmp_path):
    with pytest.raises(UserError, match=rf"data.root={tmp_path}.*data.download=false.*data=synthetic"):
        CIFAR10DataModule(root=str(tmp_path), download=False).prepare_data()


def test_missing_data_with_an_unreachable_server_fails_fast_and_names_data_root(tmp_path):
    dm = CIFAR10DataModule(root=str(tmp_path), download=True, download_url="http://127.0.0.1:9/cifar-10-python.tar.gz")
    with pytest.raises(UserError, match=rf"not under data.root={tmp_path}.*127.0.0.1:9.*data=synthetic"):
        dm.prepare_data()
    assert not (tmp_path / "cifar-10-batches-py").exists() and not (tmp_path / "cifar-10-python.tar.gz").exists()


def test_val_size_that_leaves_nothing_to_train_on_is_a_user_error(cifar_root):
    with pytest.raises(UserError, match="data.val_size=100"):
        CIFAR10DataModule(root=str(cifar_root), download=False, val_size=100).setup("fit")


@pytest.mark.parametrize("batch_size", [0, -4])
def test_batch_size_below_one_is_a_user_error(batch_size):
    with pytest.raises(UserError, match=f"data.batch_size={batch_size}"):
        SyntheticDataModule(batch_size=batch_size)


def test_real_sample_reads_in_release_order_with_its_statistics(sample_root, caplog):
    dm = CIFAR10DataModule(root=str(sample_root), download=False, batch_size=100)
    with caplog.at_level(logging.WARNING):
        dm.prepare_data()
    assert "not the canonical release" in caplog.text
    images, labels = read_batch(sample_root / "cifar-10-batches-py" / "data_batch_1")
    assert images.shape == (1000, 3, 32, 32) and labels[:10].tolist() == [6, 9, 9, 4, 1, 1, 2, 7, 8, 3]
    dm.setup("fit")
    assert (len(dm.train_set), len(dm.val_set), len(dm.test_set)) == (4500, 500, 1000)
    # channel order and scale are right: the sample's per-channel means are CIFAR-10's to within a few %
    means = dm.train_set.images.float().mean(dim=(0, 2, 3)) / 255
    assert torch.allclose(means, torch.tensor(CIFAR10_MEAN), atol=0.03)
    normalised = torch.stack([dm.test_set[i][0] for i in range(1000)])
    assert normalised.mean(dim=(0, 2, 3)).abs().max() < 0.15
    assert (normalised.std(dim=(0, 2, 3)) - 1).abs().max() < 0.15
    assert torch.tensor(CIFAR10_STD).min() > 0


def test_training_augmentation_crops_and_flips_but_evaluation_does_not(sample_root):
    dm = CIFAR10DataModule(root=str(sample_root), download=False)
    dm.setup("fit")
    raw = dm.train_set.images[0]
    views = torch.stack([dm.train_set[0][0] for _ in range(200)])
    assert len({bytes(v.numpy()) for v in views}) > 50  # crop offsets x flips: many distinct views
    plain = dm.val_set[0][0]
    assert torch.equal(plain, dm.val_set[0][0])
    expected = (raw.float() / 255 - torch.tensor(CIFAR10_MEAN)[:, None, None]) / torch.tensor(CIFAR10_STD)[:, None, None]
    assert torch.allclose(dm.val_set.transform(raw), expected, atol=1e-5)
    assert views.shape == (200, 3, 32, 32)


def test_synthetic_data_is_deterministic_sized_and_class_dependent():
    a = SyntheticDataModule(num_train=200, num_test=50, image_size=24, seed=1)
    b = SyntheticDataModule(num_train=200, num_test=50, image_size=24, seed=1)
    a.setup("fit"), b.setup("fit")
    assert torch.equal(a.train_set.images, b.train_set.images)
    assert a.train_set.images.shape == (180, 3, 24, 24) and len(a.val_set) == 20 and len(a.test_set) == 50
    # the per-class mean images differ far more than the noise between two halves of one class
    x, y = a.train_set.images.float(), a.train_set.labels
    class_means = torch.stack([x[y == c].mean(0) for c in range(10)])
    spread = torch.cdist(class_means.flatten(1), class_means.flatten(1))
    assert spread[~torch.eye(10, dtype=torch.bool)].min() > 20
    assert set(np.unique(y.numpy())) == set(range(10))
