"""The Lightning backend: a LightningModule that executes the Plan."""
