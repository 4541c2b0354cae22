"""hf_megatron: Megatron-style parallel training for Hugging Face transformers models."""
from .config import ConfigError, ModelConfig
from . import architectures  # noqa: F401  (installs the HF config reader of ModelConfig.from_hf)
from .loading import from_pretrained
from .model import GPTModel

__version__ = "0.1.0"
__all__ = ["ModelConfig", "ConfigError", "GPTModel", "from_pretrained", "Accelerator", "__version__"]


def __getattr__(name: str):
    # `from hf_megatron import Accelerator`: imported on first use only, so `import hf_megatron`
    # (and every lower layer that reads __version__ from the root) stays free of accelerate and
    # of the integrations layer
    if name == "Accelerator":
        import importlib
        return importlib.import_module(".integrations.accelerate", __name__).Accelerator
    raise AttributeError(f"module 'hf_megatron' has no attribute {name!r}")
