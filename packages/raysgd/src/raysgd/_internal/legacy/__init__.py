"""The earliest RaySGD's names, kept working: `PyTorchTrainer` (`trainer`) and its Tune
trainable `PyTorchTrainable` (`trainable`, which imports Ray Tune when first used)."""
