"""The MoE transformer language model and its configuration."""

from .build import build_model, register_builder
from .transformer import QUANTIZABLE, LMOutput, ModelConfig, MoETransformer, RMSNorm

__all__ = ["QUANTIZABLE", "LMOutput", "ModelConfig", "MoETransformer", "RMSNorm", "build_model", "register_builder"]
