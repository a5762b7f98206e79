"""Python bindings for libdflash (ctypes over the C library's stable ABI).

Handles are context managers; numpy arrays go in and come out without copies
where the C API allows.

Errors
------
Every failing library call raises a subclass of `libdflash.Error` that also
derives from the built-in exception a Python user would expect, so both
`except libdflash.Error` and, say, `except FileNotFoundError` catch it. Each
carries `.status` (the dflash_status name), `.code` (its number) and
`.message` (the library's detail: the file, line, tensor, id or URL at fault);
str(e) is "STATUS: message". OSError kinds also set `.errno` where one fits.

    dflash_status          class                  also a
    DFLASH_E_INVALID_ARG   InvalidArgumentError   ValueError
    DFLASH_E_NOMEM         OutOfMemoryError       MemoryError
    DFLASH_E_IO            InputOutputError       OSError
      - from a call opening a local path that does not exist (the tokenizer
        loader reports ENOENT so): MissingFileError (FileNotFoundError)
    DFLASH_E_FORMAT        FormatError            ValueError
    DFLASH_E_TRUNCATED     TruncatedError         FormatError, ValueError
    DFLASH_E_RANGE         RangeError             ValueError
      - from a call that takes an index (a sample, tensor, token id, span,
        listing entry, server, parameter or order position):
                           IndexRangeError        RangeError, IndexError
    DFLASH_E_OVERFLOW      SizeOverflowError      OverflowError
    DFLASH_E_DTYPE         DtypeError             ValueError, TypeError
    DFLASH_E_UTF8          Utf8Error              UnicodeError (a ValueError)
    DFLASH_E_DUPLICATE     DuplicateError         ValueError
    DFLASH_E_NOT_FOUND     NotFoundError          LookupError
      - a file, directory or object that does not exist (opening or loading
        a path; storage reads, stats, copies, listings):
                           MissingFileError       NotFoundError, FileNotFoundError
      - a name or id looked up by key (tensor, metadata key, sample id,
        template name, parameter, token; Dataset["id"]):
                           MissingKeyError        NotFoundError, KeyError
      - where a call reads a file and then names inside it (Trainer.load,
        load_target_head, train_run, eval): MissingFileError when one of its
        local paths does not exist, NotFoundError otherwise
    DFLASH_E_JSON          JSONError              ValueError
    DFLASH_E_BUFFER        BufferTooSmallError    ValueError
    DFLASH_E_UNSUPPORTED   UnsupportedError       NotImplementedError
    DFLASH_E_STATE         StateError             RuntimeError
    DFLASH_E_CONFIG        ConfigError            ValueError
    DFLASH_E_MISMATCH      MismatchError          ValueError
    DFLASH_E_REGEX         RegexError             ValueError
    DFLASH_E_TEMPLATE      TemplateError          ValueError
    DFLASH_E_HTTP          HTTPError              OSError
    DFLASH_E_NETWORK       NetworkError           ConnectionError
    DFLASH_E_TIMEOUT       DeadlineError          TimeoutError
    DFLASH_E_CANCELLED     CancelledError         (libdflash.Error only)
    DFLASH_E_CUDA          CudaError              RuntimeError
    DFLASH_E_NO_DEVICE     NoDeviceError          RuntimeError
    DFLASH_E_INTERNAL      InternalError          RuntimeError
    DFLASH_E_AUTH          AuthError              PermissionError
    DFLASH_E_EXISTS        ExistsError            FileExistsError

A status this package does not know (a newer library) raises libdflash.Error
itself. Errors pickle (multiprocessing) as the same class, status and message.
A closed handle raises ValueError ("Tokenizer is closed"), an argument of the
wrong Python type TypeError or ValueError, as Python's own objects do.
"""
from ._lib import Error, ERROR_CLASSES
from ._lib import (InvalidArgumentError, OutOfMemoryError, InputOutputError, FormatError,
                   TruncatedError, RangeError, IndexRangeError, SizeOverflowError, DtypeError,
                   Utf8Error, DuplicateError, NotFoundError, MissingFileError, MissingKeyError,
                   JSONError, BufferTooSmallError, UnsupportedError, StateError, ConfigError,
                   MismatchError, RegexError, TemplateError, HTTPError, NetworkError,
                   DeadlineError, CancelledError, CudaError, NoDeviceError, InternalError,
                   AuthError, ExistsError)
from ._version import __version__
from ._core import version, status_name, cuda_device_count, blas_kernels
from ._core import last_error, clear_error, set_log_callback, log_to_python
from .progress import Progress
from .safetensors import SafeTensors, write_safetensors, write_index, DTYPES
from .tokenizer import Tokenizer
from .chat import ChatTemplate, Conversation
from .chat_tools import tools_typescript
from .dataset import Dataset, DatasetWriter, build_dataset
from .fetch import fetch, Fetcher
from .storage import Storage, is_remote
from .hidden import HiddenWriter, HiddenStore, SampleStream, Spool, hidden_layout, is_vllm_hidden_file
from .train import Trainer, train_run

__all__ = ["Error", "version", "status_name", "cuda_device_count", "blas_kernels",
           "SafeTensors", "write_safetensors", "write_index", "DTYPES",
           "Tokenizer", "ChatTemplate", "Dataset", "fetch", "Storage", "is_remote",
           "HiddenWriter", "HiddenStore", "SampleStream", "Spool", "Trainer",
           "hidden_layout", "is_vllm_hidden_file",
           "last_error", "clear_error", "set_log_callback", "log_to_python", "Progress",
           "DatasetWriter", "build_dataset", "Conversation", "Fetcher", "train_run", "tools_typescript", "__version__"]
__all__ += [cls.__name__ for cls in ERROR_CLASSES]
