"""Training engine: configuration, mixed-precision optimizer, LR schedules, `train_step`."""
from .config import RunConfig, TrainingConfig
from .loss_scaler import LossScaler
from .optimizer import MixedPrecisionOptimizer, param_groups
from .schedules import LRScheduler
from .trainer import build_model, build_optimizer, build_scheduler, evaluate, setup_parallel, split_batch, train_step

__all__ = ["LossScaler", "MixedPrecisionOptimizer", "param_groups", "LRScheduler", "TrainingConfig", "RunConfig",
           "build_model", "build_optimizer", "build_scheduler", "evaluate", "setup_parallel", "split_batch",
           "train_step"]
