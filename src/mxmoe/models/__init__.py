"""The MoE transformer language model and its configuration."""

from .transformer import QUANTIZABLE, LMOutput, ModelConfig, MoETransformer, RMSNorm

__all__ = ["QUANTIZABLE", "LMOutput", "ModelConfig", "MoETransformer", "RMSNorm"]
