"""LightningDataModules: CIFAR-10 from its python-version batches, and synthetic images for offline runs."""
