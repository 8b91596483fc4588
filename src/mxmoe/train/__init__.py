"""Training: corpora and batches, the training loop, checkpoints and metrics."""

from .checkpoint import load_checkpoint, save_checkpoint
from .data import Corpus, load_corpus
from .trainer import TrainConfig, TrainResult, lr_at, train

__all__ = ["Corpus", "TrainConfig", "TrainResult", "load_checkpoint", "load_corpus", "lr_at", "save_checkpoint", "train"]
