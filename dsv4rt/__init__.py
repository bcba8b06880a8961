"""dsv4rt: a graph-captured inference runtime for DeepSeek-V4."""
from . import ops  # noqa: F401  (registers the dsv4rt:: custom ops)
from .cache import BlockAllocator, KVCache
from .config import ModelConfig
from .model import Model
from .runtime import CapacityError, RequestError, Runtime, UnknownRequest

__all__ = ["ModelConfig", "Model", "Runtime", "KVCache", "BlockAllocator", "RequestError", "UnknownRequest",
           "CapacityError"]
__version__ = "0.1.0"
