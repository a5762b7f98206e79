"""Python bindings for libdflash (ctypes over the C library's stable ABI)."""
from ._lib import Error
from ._core import version, status_name, cuda_device_count
from .tokenizer import Tokenizer
from .fetch import fetch

__version__ = version()

__all__ = ["Error", "version", "status_name", "cuda_device_count", "Tokenizer"]
from .safetensors import SafeTensors, write_safetensors, write_index, DTYPES  # noqa: E402

__all__ += ["SafeTensors", "write_safetensors", "write_index", "DTYPES"]
from .chat import ChatTemplate  # noqa: E402
from .dataset import Dataset  # noqa: E402

__all__ += ["ChatTemplate", "Dataset"]
from .storage import Storage, is_remote  # noqa: E402
from .train import Trainer  # noqa: E402
from .hidden import HiddenWriter, HiddenStore, SampleStream  # noqa: E402

__all__ += ["Trainer", "HiddenWriter", "HiddenStore", "SampleStream"]
