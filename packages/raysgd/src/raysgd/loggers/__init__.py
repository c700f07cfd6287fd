"""Experiment loggers: record a `TorchTrainer` run in MLflow, Weights & Biases, TensorBoard or CSV.

    from raysgd import TorchTrainer
    from raysgd.loggers import CSVLogger, MLflowLogger, WandbLogger

    trainer = TorchTrainer(..., loggers=[MLflowLogger(), WandbLogger(project="demo"), "csv"])

Every reduced `train()` / `validate()` result, the config and the trainer's options, and the
recovery events are recorded by the driver; nothing runs on the workers. `Logger` (in
`raysgd.loggers.logger`) documents the interface and when each method is called; subclass it for
another tracker and pass an instance, register it with `register_logger`, or publish it in the
entry-point group ``raysgd.logger``. The optional libraries come with the extras
``raysgd[mlflow]``, ``raysgd[wandb]`` and ``raysgd[tensorboard]``; a logger whose library is missing
raises ImportError when it is built, never on ``import raysgd``.
"""

from raysgd.loggers.csv_logger import CSVLogger
from raysgd.loggers.logger import (
    Logger,
    TuneTrial,
    current_trial,
    event_fields,
    event_metrics,
    flatten_metrics,
    flatten_params,
)
from raysgd.loggers.mlflow_logger import MLflowLogger
from raysgd.loggers.registry import (
    ENTRY_POINT_GROUP,
    available_loggers,
    get_logger,
    register_logger,
)
from raysgd.loggers.tensorboard_logger import TensorBoardLogger
from raysgd.loggers.wandb_logger import WandbLogger

__all__ = [
    "ENTRY_POINT_GROUP",
    "CSVLogger",
    "Logger",
    "MLflowLogger",
    "TensorBoardLogger",
    "TuneTrial",
    "WandbLogger",
    "available_loggers",
    "current_trial",
    "event_fields",
    "event_metrics",
    "flatten_metrics",
    "flatten_params",
    "get_logger",
    "register_logger",
]
