"""Python bindings for libdflash (ctypes over the C library's stable ABI).

Every failing call raises dflash.Error(status, message). Handles are context
managers; numpy arrays go in and come out without copies where the C API allows.
"""
from ._lib import Error
from ._version import __version__
from ._core import version, status_name, cuda_device_count
from ._core import last_error, clear_error, set_log_callback, log_to_python
from .progress import Progress
from .safetensors import SafeTensors, write_safetensors, write_index, DTYPES
from .tokenizer import Tokenizer
from .chat import ChatTemplate, Conversation
from .chat_tools import tools_typescript
from .dataset import Dataset, DatasetWriter
from .fetch import fetch, Fetcher
from .storage import Storage, is_remote
from .hidden import HiddenWriter, HiddenStore, SampleStream
from .train import Trainer, train_run

__all__ = ["Error", "version", "status_name", "cuda_device_count",
           "SafeTensors", "write_safetensors", "write_index", "DTYPES",
           "Tokenizer", "ChatTemplate", "Dataset", "fetch", "Storage", "is_remote",
           "HiddenWriter", "HiddenStore", "SampleStream", "Trainer",
           "last_error", "clear_error", "set_log_callback", "log_to_python", "Progress",
           "DatasetWriter", "Conversation", "Fetcher", "train_run", "tools_typescript", "__version__"]
