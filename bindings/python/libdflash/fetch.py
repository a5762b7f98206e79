"""Completion fetcher: regenerate assistant turns with OpenAI-compatible servers.

    summary = libdflash.fetch("prompts.jsonl", "out/", servers=["http://host:30000/v1"],
                           model="kimi-k2", family="kimi", max_tokens=4096)

writes out/completions.jsonl and out/errors.jsonl (see include/dflash/fetch.h)
and returns the run's summary as a dict. Running it again resumes.
"""
import ctypes
import json

from ._lib import INDEX, Error, Handle, bind, cstr

_FAMILIES = {"none": 0, "kimi": 1, "qwen": 2}


class _Options(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("servers", ctypes.POINTER(ctypes.c_char_p)),
        ("n_servers", ctypes.c_size_t),
        ("model", ctypes.c_char_p),
        ("family", ctypes.c_int32),
        ("thinking", ctypes.c_int32),
        ("max_tokens", ctypes.c_int32),
        ("temperature", ctypes.c_double),
        ("top_p", ctypes.c_double),
        ("top_k", ctypes.c_int32),
        ("min_p", ctypes.c_double),
        ("seed", ctypes.c_int64),
        ("stop_json", ctypes.c_char_p),
        ("extra_json", ctypes.c_char_p),
        ("stream", ctypes.c_int32),
        ("api_key_env", ctypes.c_char_p),
        ("api_key_file", ctypes.c_char_p),
        ("concurrency", ctypes.c_int32),
        ("connect_timeout_s", ctypes.c_double),
        ("idle_timeout_s", ctypes.c_double),
        ("deadline_s", ctypes.c_double),
        ("deadline_base_s", ctypes.c_double),
        ("deadline_per_token_s", ctypes.c_double),
        ("max_attempts", ctypes.c_int32),
        ("backoff_base_s", ctypes.c_double),
        ("backoff_max_s", ctypes.c_double),
        ("retry_after_max_s", ctypes.c_double),
        ("fsync_interval_s", ctypes.c_double),
        ("retry_errors", ctypes.c_int32),
        ("shard_index", ctypes.c_uint32),
        ("shard_count", ctypes.c_uint32),
        ("fail_threshold", ctypes.c_int32),
        ("probe_interval_s", ctypes.c_double),
        ("max_response_bytes", ctypes.c_uint64),
        ("verify_tls", ctypes.c_int32),
        ("all_turns", ctypes.c_int32),
        ("drain_grace_s", ctypes.c_double),
        ("progress_interval_s", ctypes.c_double),
        ("send_rid", ctypes.c_int32),
        ("max_concurrency", ctypes.c_int32),
        ("server_state", ctypes.c_int32),
        ("state_interval_s", ctypes.c_double),
        # the guards and the chunking of s3:// outputs
        ("no_server_check", ctypes.c_int32), ("skip_bad_servers", ctypes.c_int32),
        ("down_timeout_s", ctypes.c_double), ("settings_change", ctypes.c_int32),
        ("chunk_worker", ctypes.c_char_p), ("chunk_max_records", ctypes.c_uint64),
        ("chunk_max_seconds", ctypes.c_double),
        # an id means one prompt
        ("new_ids", ctypes.c_int32), ("keep_first_duplicates", ctypes.c_int32),
    ]

# dflash_fetch_stop_reason, named as the summary's "stop_reason"
_STOP_REASONS = {0: None, 1: "stop", 2: "down_timeout", 3: "server_check", 4: "settings"}


class Stats(ctypes.Structure):
    """Counters handed to a progress callback (see dflash_fetch_stats)."""
    _fields_ = [(name, ctypes.c_uint64) for name in (
        "total", "skipped", "completed", "failed", "input_errors", "duplicates", "length",
        "empty", "retries", "in_flight", "pending", "prompt_tokens", "completion_tokens")]
    _fields_ = ([("struct_size", ctypes.c_size_t)] + _fields_ +
                [("elapsed_s", ctypes.c_double), ("servers_healthy", ctypes.c_uint32),
                 ("stopping", ctypes.c_int32), ("stop_reason", ctypes.c_int32),
                 ("servers_down", ctypes.c_uint32)] +
                [(name, ctypes.c_uint64) for name in (
                    "errors_earlier", "attempts_failed", "probes_failed", "overloaded",
                    "turns_counted", "turns_uncounted", "renamed")] +
                [(name, ctypes.c_double) for name in (
                    "down_s", "down_timeout_s", "prompts_per_s", "completion_tok_per_s")])

    def as_dict(self):
        out = {name: getattr(self, name) for name, _ in self._fields_[1:]}
        out["stop_reason"] = _STOP_REASONS.get(self.stop_reason, self.stop_reason)
        return out


class ServerStats(ctypes.Structure):
    """Per-server counters (see dflash_fetch_server_stats)."""
    _fields_ = [("struct_size", ctypes.c_size_t), ("url", ctypes.c_char_p),
                ("healthy", ctypes.c_uint32), ("in_flight", ctypes.c_uint32),
                ("requests", ctypes.c_uint64), ("completed", ctypes.c_uint64),
                ("failures", ctypes.c_uint64), ("completion_tokens", ctypes.c_uint64),
                ("concurrency", ctypes.c_uint32), ("tok_per_s", ctypes.c_double),
                ("excluded", ctypes.c_uint32), ("overloaded", ctypes.c_uint32)]

    def as_dict(self):
        out = {name: getattr(self, name) for name, _ in self._fields_[1:]}
        out["url"] = self.url.decode()
        out["healthy"] = bool(self.healthy)
        out["excluded"] = bool(self.excluded)
        return out


_PROGRESS = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(Stats), ctypes.c_void_p)

_defaults = bind("dflash_fetch_options_init", [ctypes.POINTER(_Options), ctypes.c_size_t], None)
_create = bind("dflash_fetch_create", [ctypes.POINTER(_Options), ctypes.c_char_p, ctypes.c_char_p,
                                       ctypes.POINTER(ctypes.c_void_p)])
_run = bind("dflash_fetch_run", [ctypes.c_void_p, _PROGRESS, ctypes.c_void_p])
_summary = bind("dflash_fetch_summary", [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t,
                                         ctypes.POINTER(ctypes.c_size_t)])
_free = bind("dflash_fetch_free", [ctypes.c_void_p], None)
_SETTINGS_CHANGE = {"warn": 0, "refuse": 1, "allow": 2}
_stop = bind("dflash_fetch_stop", [ctypes.c_void_p], None)
_get_stats = bind("dflash_fetch_get_stats", [ctypes.c_void_p, ctypes.POINTER(Stats)])
_server_count = bind("dflash_fetch_server_count", [ctypes.c_void_p], ctypes.c_size_t)
_server_stats = bind("dflash_fetch_get_server_stats", [ctypes.c_void_p, ctypes.c_size_t,
                                                       ctypes.POINTER(ServerStats)], errors=INDEX)
_record_id = bind("dflash_fetch_record_id", [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_char_p,
                                             ctypes.c_size_t])

# keyword -> (options field, conversion)
_SIMPLE = {
    "max_tokens": "max_tokens", "top_k": "top_k", "concurrency": "concurrency",
    "connect_timeout": "connect_timeout_s", "idle_timeout": "idle_timeout_s",
    "deadline": "deadline_s", "max_attempts": "max_attempts", "backoff": "backoff_base_s",
    "backoff_max": "backoff_max_s", "fsync_interval": "fsync_interval_s",
    "fail_threshold": "fail_threshold", "probe_interval": "probe_interval_s",
    "max_response_bytes": "max_response_bytes", "drain_grace": "drain_grace_s",
    "progress_interval": "progress_interval_s", "max_concurrency": "max_concurrency",
    "state_interval": "state_interval_s", "down_timeout": "down_timeout_s",
    "chunk_records": "chunk_max_records", "chunk_seconds": "chunk_max_seconds",
}
_FLAGS = {"thinking": "thinking", "stream": "stream", "retry_errors": "retry_errors",
          "verify_tls": "verify_tls", "all_turns": "all_turns", "send_rid": "send_rid",
          "server_state": "server_state", "skip_bad_servers": "skip_bad_servers",
          "new_ids": "new_ids", "keep_first_duplicates": "keep_first_duplicates"}
_UNSET_IF_NONE = {"temperature": "temperature", "top_p": "top_p", "min_p": "min_p",
                  "seed": "seed"}


def _options(servers, model, family, kw, keep):
    o = _Options()
    _defaults(ctypes.byref(o), ctypes.sizeof(o))
    if isinstance(servers, str):
        servers = [servers]
    arr = (ctypes.c_char_p * len(servers))(*[cstr(s) for s in servers])
    keep.append(arr)
    o.servers, o.n_servers = arr, len(servers)
    o.model = cstr(model)
    if family not in _FAMILIES:
        raise ValueError(f"family must be one of {sorted(_FAMILIES)}, not {family!r}")
    o.family = _FAMILIES[family]
    for key, value in kw.items():
        if key in _SIMPLE:
            setattr(o, _SIMPLE[key], value)
        elif key in _FLAGS:
            setattr(o, _FLAGS[key], 1 if value else 0)
        elif key in _UNSET_IF_NONE:
            if value is not None:
                setattr(o, _UNSET_IF_NONE[key], value)
        elif key in ("stop", "extra"):
            if value is not None:
                setattr(o, key + "_json", json.dumps(value).encode())
        elif key in ("api_key_env", "api_key_file"):
            setattr(o, key, cstr(value))
        elif key == "shard":
            o.shard_index, o.shard_count = value
        elif key == "server_check":
            o.no_server_check = 0 if value else 1
        elif key == "settings_change":
            o.settings_change = _SETTINGS_CHANGE[value]
        elif key == "worker":
            o.chunk_worker = cstr(value)
        else:
            raise TypeError(f"fetch() got an unexpected keyword argument {key!r}")
    return o


def _summary_of(handle):
    n = ctypes.c_size_t(0)
    try:
        _summary(handle, None, 0, ctypes.byref(n))
    except Error as e:
        if e.status != "DFLASH_E_BUFFER":
            raise
    buf = ctypes.create_string_buffer(n.value)
    _summary(handle, buf, n.value, ctypes.byref(n))
    return json.loads(buf.value.decode())


class Fetcher(Handle):
    """One fetch job, prepared: Fetcher(input, out_dir, servers, model, family, **options)
    scans the input and the outputs already in out_dir (options as for fetch()).

    run() fetches everything; stop() (from any thread, e.g. a progress callback
    or a signal handler) asks a running fetcher to stop; stats(),
    server_stats() and summary() report counters at any time.
    """

    _free = "dflash_fetch_free"

    def __init__(self, input, out_dir, servers, model, family="none", **options):
        self._keep = []
        o = _options(servers, model, family, options, self._keep)
        h = ctypes.c_void_p()
        _create(ctypes.byref(o), cstr(input), cstr(out_dir), ctypes.byref(h))
        self._h = h

    def _fetcher(self):
        if not self._h:
            raise ValueError("Fetcher is closed")
        return self._h

    def run(self, progress=None):
        """Fetch every prompt. progress: optional callable(stats: dict) -> bool,
        called on this thread every progress_interval seconds and at the end;
        True (or KeyboardInterrupt) stops the run after in-flight requests drain.
        Returns True when everything finished, False when the run was stopped
        (run again, or re-create, to resume)."""
        interrupted = []

        def on_progress(_f, stats, _user):
            try:
                return 1 if progress(stats.contents.as_dict()) else 0
            except KeyboardInterrupt:
                interrupted.append(True)
                return 1

        cb = _PROGRESS(on_progress) if progress else _PROGRESS()
        try:
            _run(self._fetcher(), cb, None)
            finished = True
        except Error as e:
            if e.status != "DFLASH_E_CANCELLED":
                raise
            finished = False
        if interrupted:
            raise KeyboardInterrupt
        return finished

    def stop(self):
        """Ask a running fetcher to stop (a second call stops at once). Thread-safe."""
        _stop(self._fetcher())

    def stats(self):
        """The run's counters as a dict (see dflash_fetch_stats; "stop_reason" is None,
        "stop", "down_timeout", "server_check" or "settings")."""
        s = Stats(struct_size=ctypes.sizeof(Stats))
        _get_stats(self._fetcher(), ctypes.byref(s))
        return s.as_dict()

    def server_stats(self):
        """Per-server counters: a list of dicts (url, healthy, in_flight, requests,
        completed, failures, completion_tokens)."""
        out = []
        for i in range(_server_count(self._fetcher())):
            s = ServerStats(struct_size=ctypes.sizeof(ServerStats))
            _server_stats(self._fetcher(), i, ctypes.byref(s))
            out.append(s.as_dict())
        return out

    def summary(self):
        """The run's JSON summary as a dict."""
        return _summary_of(self._fetcher())


def fetch(input, out_dir, servers, model, family="none", progress=None, **options):
    """Fetch completions for every conversation in `input` (JSONL) into `out_dir`.

    servers: base URL or list of them; family: "kimi", "qwen" or "none".
    progress: optional callable(stats: dict) -> bool, called every progress_interval
    seconds on the fetching thread; returning True (or raising KeyboardInterrupt)
    stops the run after in-flight requests drain.
    Other options mirror dflash_fetch_options (max_tokens, temperature, top_p,
    top_k, min_p, seed, stop, extra (a dict), stream, api_key_env, api_key_file,
    concurrency (0, the default: each server's own, found by a controller capped at
    max_concurrency; N: exactly N per server), server_state, connect_timeout, idle_timeout, deadline, max_attempts, backoff,
    fsync_interval, retry_errors, shard=(i, n), all_turns, max_response_bytes; the guards
    server_check (True), skip_bad_servers, down_timeout (0: 600 s; < 0: never),
    settings_change ("warn", "refuse", "allow"); an id means one prompt: new_ids
    (conflicting prompts under "<id>#2"), keep_first_duplicates; s3:// chunks: worker, chunk_records,
    chunk_seconds, ...).
    Returns the summary dict; summary["stopped"] is True when the run was stopped.
    Fetcher gives the same job step by step.
    """
    with Fetcher(input, out_dir, servers, model, family, **options) as f:
        f.run(progress)
        return f.summary()


def record_id(line):
    """The id fetch gives a JSONL line: its "id", else "h" + 32 hex digits of SHA-256
    over the compact, key-sorted JSON of its normalised messages."""
    data = line.encode() if isinstance(line, str) else line
    out = ctypes.create_string_buffer(256)
    _record_id(data, len(data), out, len(out))
    return out.value.decode()
