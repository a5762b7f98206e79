"""Python bindings for libdflash (ctypes over the C library's stable ABI).

Every failing call raises dflash.Error(status, message). Handles are context
managers; numpy arrays go in and come out without copies where the C API allows.
"""
from ._lib import Error
from ._core import version, status_name, cuda_device_count
from .safetensors import SafeTensors, write_safetensors, write_index, DTYPES
from .tokenizer import Tokenizer
from .chat import ChatTemplate
from .dataset import Dataset
from .fetch import fetch
from .storage import Storage, is_remote
from .hidden import HiddenWriter, HiddenStore, SampleStream
from .train import Trainer

__version__ = version()

__all__ = ["Error", "version", "status_name", "cuda_device_count",
           "SafeTensors", "write_safetensors", "write_index", "DTYPES",
           "Tokenizer", "ChatTemplate", "Dataset", "fetch", "Storage", "is_remote",
           "HiddenWriter", "HiddenStore", "SampleStream", "Trainer"]
