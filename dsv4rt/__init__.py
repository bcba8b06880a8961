"""dsv4rt: a graph-captured inference runtime for DeepSeek-V4."""
import pathlib as _pathlib

# ops/ and graphs/ sit beside this package in the source tree and install as dsv4rt.ops / dsv4rt.graphs
# (pyproject.toml). A plain checkout on PYTHONPATH finds them through this package's search path.
_ROOT = _pathlib.Path(__file__).resolve().parent.parent
if not (_pathlib.Path(__file__).parent / "ops").exists() and (_ROOT / "ops" / "__init__.py").exists():
    __path__.append(str(_ROOT))  # noqa: F821 (package __path__)
from . import ops  # noqa: F401  (registers the dsv4rt:: custom ops)
from .cache import BlockAllocator, KVCache
from .checkpoint import CheckpointError
from .config import ModelConfig
from .model import Model
from .runtime import CapacityError, RequestError, Runtime, UnknownRequest, greedy_tokens

__all__ = ["ModelConfig", "Model", "Runtime", "KVCache", "BlockAllocator", "RequestError", "UnknownRequest",
           "CapacityError", "CheckpointError", "greedy_tokens"]
__version__ = "0.1.0"
