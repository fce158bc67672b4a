"""The networks (torchvision ResNets) and the LightningModule that trains them."""
