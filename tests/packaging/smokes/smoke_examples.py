"""raysgd-examples: every module imports (the benchmarks' too), and the digits example's operator
trains in this process on scikit-learn's digits, prepared under its file lock (no Ray here: the
trainer runs in the raysgd smoke, and every example runs in tests/examples)."""

import tempfile

from _smoke import import_every_module, report

from raysgd_examples.digits import DigitsOperator
from raysgd_operator import BATCH_SIZE, OperatorRunner

imported = import_every_module("raysgd_examples")
with tempfile.TemporaryDirectory() as data_dir:
    config = {"lr": 2e-3, BATCH_SIZE: 64, "data_dir": data_dir, "width": 8}
    runner = OperatorRunner(DigitsOperator, config)
    epochs = [runner.train_epoch() for _ in range(2)]
    validation = runner.validate()

report("raysgd_examples", imported=imported, epochs=epochs, validation=validation)
