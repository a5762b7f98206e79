#!/usr/bin/env python3
"""A fake OpenAI-compatible chat server for testing the fetcher, stdlib only.

One process serves N ports (N "servers") that share their state, so a
prompt's attempt count is known whichever server an attempt lands on. HTTP/1.1
with keep-alive; streamed answers use chunked transfer encoding and SSE, as
uvicorn does for SGLang and vLLM.

Generation is deterministic: `generate(messages, max_tokens)` derives the
reasoning and content tokens from SHA-256 of the messages, so a test computes
the expected output on its own.

Faults are asked for inside the last user message, e.g. "[[fault:503*2]]":
  503*K 500*K 429*K (with ;ra=SECONDS Retry-After)   the first K attempts get that status
  reset*K      stream a few chunks, then a TCP reset
  trunc*K      stream a few chunks, then close without ending the chunked body
  errevent*K   HTTP 200, a chunk, then data: {"error": {..., "code": 503}}
  stall*K      stream a few chunks, then go silent (for --stall seconds), then close
  hang*K       read the request and never answer (for --stall seconds)
  badjson*K    HTTP 200 with a cut-off JSON body (non-streamed) or chunk (streamed)
  abort*K      finish_reason "abort" (SGLang under load)
  nofinish*K   HTTP 200, a few chunks, the usage chunk and data: [DONE], but no chunk
               with a finish_reason (SGLang aborting a request); non-streamed: a whole
               body with "finish_reason": null
  400, errevent400   permanent errors
  drip         each token after 0.2 s (--token-delay sets a delay for every stream)
  split        the SSE bytes in 1..7 byte chunks with CRLF line ends
  keepalive    ": keep-alive" comments between events
  length       finish_reason "length" with content cut (reasoning only)
  empty        finish_reason "stop" with empty content
  rfield=NAME  send reasoning as NAME ("reasoning" or "reasoning_content")
Faults marked *K apply to the K first attempts in the order written;
"[[fault:503*1]][[fault:reset*1]]" means a 503, then a reset, then success.

--usage KIND[,KIND...] sets how each port reports token counts (the list is cycled over
the ports, so "openai,none" makes port 0 count and port 1 not):
  openai   (default) OpenAI, vLLM, SGLang: "usage" in a non-streamed body; in a stream only
           when the request asks for stream_options.include_usage, as a last chunk with
           "choices": [] before [DONE]. A request with stream_options that is not streamed
           gets 400, as vLLM's validate_stream_options (and OpenAI) answer.
  llama    llama-server as of b11434 (tools/server/server-task.cpp,
           to_json_oaicompat_chat_stream): the same usage rule (it honours include_usage
           since ggml-org/llama.cpp#16052; before, #15444, the usage chunk came always),
           usage with prompt_tokens_details.cached_tokens, and "timings" {cache_n,
           prompt_n (prompt tokens not from the cache), predicted_n, ...} on the last chunk
           of a stream (the usage chunk, else the finish_reason chunk) and in bodies.
  timings  a llama.cpp server whose streams carry timings but no usage whatever the
           request says: llama-server's stream when include_usage does not reach it (its
           default since #16052; a proxy that drops stream_options). Bodies as llama.
  none     no token counts at all, streamed or not: no usage, no timings.
The fake's prompt "tokens" are len(json(messages)) // 4; llama and timings pretend a
third of them came from the prompt cache.

--models LIST[;LIST...] sets the ids GET /v1/models lists, comma-separated, per port (the
lists are cycled over the ports like --usage; default "fake"). --api-key KEY makes every
endpoint answer 401 (as vLLM's --api-key does) unless the request has
"Authorization: Bearer KEY"; --forbid-key KEY answers 403 to that one key.

--chaos P adds random faults (seeded by prompt and attempt) to the first two
attempts of a fraction P of prompts.

Control (JSON over HTTP on --control-port): GET /stats, GET /requests,
POST /down {"port": P, "seconds": S} (the port refuses connections and drops
the ones it has, then comes back), POST /reset.

Prints one JSON line {"ports": [...], "control": P} when ready.
"""
import argparse
import hashlib
import http.server
import json
import random
import re
import socket
import socketserver
import struct
import sys
import threading
import time

VOCAB = ["the", "answer", "is", " é", "日本", "\"q\"", "\\", "\n", "ok", "42", "🙂", "tab\t"]
FAULT_RE = re.compile(r"\[\[fault:([^\]]*)\]\]")


def key_of(messages):
    text = json.dumps(messages, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()


def generate(messages, max_tokens=None, empty=False, force_length=False):
    """(reasoning tokens, content tokens, finish_reason, completion_tokens)."""
    h = hashlib.sha256(key_of(messages).encode()).digest()
    n_reason = 3 + h[0] % 6
    n_content = 2 + h[1] % 8
    reasoning = [f"r{h[2 + i]:02x} " for i in range(n_reason)]
    content = [VOCAB[h[10 + i] % len(VOCAB)] + " " for i in range(n_content)]
    if empty:
        content = []
    finish = "stop"
    if force_length:
        content, finish = [], "length"
    if max_tokens and len(reasoning) + len(content) > max_tokens:
        keep = max_tokens
        reasoning, content = reasoning[:keep], content[:max(0, keep - len(reasoning))]
        finish = "length"
    return reasoning, content, finish, len(reasoning) + len(content)


def parse_faults(messages):
    """(sequence of per-attempt faults, set of always-on modes, options)."""
    last_user = ""
    for m in messages:
        if m.get("role") == "user" and isinstance(m.get("content"), str):
            last_user = m["content"]
    seq, modes, opts = [], set(), {}
    for spec in FAULT_RE.findall(last_user):
        parts = spec.split(";")
        name = parts[0]
        for p in parts[1:]:
            k, _, v = p.partition("=")
            opts[k] = v
        if name.startswith("rfield="):
            opts["rfield"] = name.split("=", 1)[1]
        elif "*" in name:
            n, _, k = name.partition("*")
            seq += [(n, dict(opts))] * int(k)
        else:
            modes.add(name)
    return seq, modes, opts


class State:
    def __init__(self, args):
        self.args = args
        self.lock = threading.Lock()
        self.attempts = {}   # prompt key -> attempts seen
        self.requests = []   # bodies and headers seen
        self.total = 0
        self.by_status = {}
        self.usage_kind = {}  # port -> how it reports token counts (--usage)
        self.models = {}      # port -> ids listed by GET /v1/models (--models)
        self.models_requests = 0

    def next_attempt(self, key):
        with self.lock:
            self.attempts[key] = self.attempts.get(key, 0) + 1
            self.total += 1
            return self.attempts[key]

    def record(self, port, body, headers):
        with self.lock:
            self.requests.append({"port": port, "body": body,
                                  "authorization": headers.get("Authorization")})

    def count(self, what):
        with self.lock:
            self.by_status[what] = self.by_status.get(what, 0) + 1


def chaos_fault(state, key, attempt):
    p = state.args.chaos
    if p <= 0 or attempt > 2:
        return None
    rng = random.Random(f"{key}:{attempt}:{state.args.seed}")
    if rng.random() >= p:
        return None
    return rng.choice(["503", "500", "429", "reset", "errevent", "trunc", "badjson"]), {}


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    state = None  # set per server class

    def log_message(self, fmt, *args):
        pass

    # ---- plumbing
    def send_json(self, status, obj, headers=None):
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)
        self.wfile.flush()

    def chunk(self, data):
        if isinstance(data, str):
            data = data.encode()
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def reset(self):
        self.wfile.flush()
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.connection.close()
        self.close_connection = True

    def hard_close(self):
        self.wfile.flush()
        self.connection.shutdown(socket.SHUT_RDWR)
        self.close_connection = True

    def kind(self):
        return self.state.usage_kind.get(self.server.server_address[1], "openai")

    def refused(self):
        """401/403 as vLLM and SGLang answer with --api-key; False when the key is fine."""
        auth = self.headers.get("Authorization")
        args = self.state.args
        if args.forbid_key and auth == f"Bearer {args.forbid_key}":
            self.send_json(403, {"error": {"message": "this key may not use the model",
                                           "code": 403}})
            return True
        if args.api_key and auth != f"Bearer {args.api_key}":
            self.send_json(401, {"error": "Unauthorized"})
            return True
        return False

    # ---- endpoints
    def do_GET(self):
        if self.path.endswith("/models"):
            with self.state.lock:
                self.state.models_requests += 1
            if self.refused():
                return
            ids = self.state.models.get(self.server.server_address[1], ["fake"])
            self.send_json(200, {"object": "list",
                                 "data": [{"id": i, "object": "model"} for i in ids]})
        else:
            self.send_json(404, {"error": {"message": "not found", "code": 404}})

    def do_POST(self):
        n = int(self.headers.get("Content-Length", "0"))
        raw = self.rfile.read(n)
        if self.refused():
            return
        if not self.path.endswith("/chat/completions"):
            return self.send_json(404, {"error": {"message": "not found", "code": 404}})
        try:
            body = json.loads(raw)
            messages = body["messages"]
        except (ValueError, KeyError) as exc:
            return self.send_json(400, {"error": {"message": f"bad request: {exc}", "code": 400}})
        self.state.record(self.server.server_address[1], body, self.headers)
        if (self.kind() == "openai" and body.get("stream_options") is not None
                and body.get("stream") is not True):  # vLLM's validate_stream_options
            return self.send_json(400, {"object": "error", "type": "BadRequestError", "code": 400,
                                        "message": "Stream options can only be defined when "
                                                   "`stream=True`."})
        if body.get("max_tokens") == 1:  # a health probe: not an attempt, never faulted
            self.state.count("probe")
            return self.answer(body, messages, set(), {}, None)
        key = key_of(messages)
        attempt = self.state.next_attempt(key)
        seq, modes, opts = parse_faults(messages)
        fault = seq[attempt - 1] if attempt <= len(seq) else chaos_fault(self.state, key, attempt)
        self.state.count(fault[0] if fault else "ok")
        if self.respond_fault(fault, messages, body):
            return
        if "400" in modes:
            return self.send_json(400, {"error": {"message": "prompt is too long", "code": 400}})
        self.answer(body, messages, modes, opts, fault[0] if fault else None)

    def respond_fault(self, fault, messages, body):
        if not fault:
            return False
        name, opts = fault
        if name in ("503", "500", "429"):
            headers = {"Retry-After": opts["ra"]} if "ra" in opts else {}
            self.send_json(int(name), {"error": {"message": f"fake {name}", "code": int(name)}},
                           headers)
            return True
        if name == "hang":
            time.sleep(self.state.args.stall)
            self.hard_close()
            return True
        if name == "badjson" and not body.get("stream"):
            data = b'{"choices": [{"message": {"content": "cut'
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            self.wfile.flush()
            return True
        if not body.get("stream") and name in ("reset", "trunc", "stall", "errevent"):
            if name == "errevent":
                self.send_json(200, {"error": {"message": "queue full", "code": 503}})
            elif name == "stall":
                time.sleep(self.state.args.stall)
                self.hard_close()
            else:  # die mid-response (before any byte, curl itself would retry once)
                self.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                                 b"Content-Length: 500\r\n\r\n{\"choices\": [")
                self.reset() if name == "reset" else self.hard_close()
            return True
        return False  # streamed faults happen inside answer()

    def answer(self, body, messages, modes, opts, fault):
        reasoning, content, finish, n_tokens = generate(
            messages, body.get("max_tokens"), empty="empty" in modes,
            force_length="length" in modes)
        if fault == "abort":
            finish = "abort"
        if fault == "nofinish":
            finish = None
        rfield = opts.get("rfield", self.state.args.reasoning_field)
        n_prompt = len(json.dumps(messages)) // 4
        usage = {"prompt_tokens": n_prompt,
                 "completion_tokens": n_tokens,
                 "total_tokens": n_prompt + n_tokens}
        kind = self.kind()
        timings = None
        if kind in ("llama", "timings"):
            cached = n_prompt // 3
            # llama-server's usage_json_oaicompat and server_slot_stats::to_json
            usage = {"completion_tokens": n_tokens, "prompt_tokens": n_prompt,
                     "total_tokens": n_prompt + n_tokens,
                     "prompt_tokens_details": {"cached_tokens": cached}}
            timings = {"cache_n": cached, "prompt_n": n_prompt - cached, "prompt_ms": 12.5,
                       "prompt_per_token_ms": 0.5, "prompt_per_second": 2000.0,
                       "predicted_n": n_tokens, "predicted_ms": 40.0 * n_tokens,
                       "predicted_per_token_ms": 40.0, "predicted_per_second": 25.0}
        if not body.get("stream"):
            if "errevent400" in modes:
                return self.send_json(200, {"error": {"message": "context length exceeded",
                                                      "code": 400}})
            msg = {"role": "assistant", "content": "".join(content),
                   rfield: "".join(reasoning)}
            answer = {"id": "chatcmpl-fake", "object": "chat.completion",
                      "model": body.get("model"),
                      "choices": [{"index": 0, "message": msg, "finish_reason": finish}]}
            if kind != "none":
                answer["usage"] = usage
            if timings:
                answer["timings"] = timings
            return self.send_json(200, answer)
        if kind in ("timings", "none"):
            usage = None  # never in a stream
        self.stream(body, reasoning, content, finish, usage, rfield, modes, fault, timings)

    def stream(self, body, reasoning, content, finish, usage, rfield, modes, fault,
               timings=None):
        key = key_of(body["messages"])
        crlf = "split" in modes
        nl = "\r\n" if crlf else "\n"

        def event(obj):
            return f"data: {json.dumps(obj)}{nl}{nl}"

        def chunk_obj(delta, fr=None):
            return {"id": "chatcmpl-fake", "object": "chat.completion.chunk",
                    "model": body.get("model"),
                    "choices": [{"index": 0, "delta": delta, "finish_reason": fr}]}

        first = None if self.kind() in ("llama", "timings") else ""  # llama-server: null
        events = [event(chunk_obj({"role": "assistant", "content": first}))]
        events += [event(chunk_obj({rfield: t})) for t in reasoning]
        events += [event(chunk_obj({"content": t})) for t in content]
        if fault == "abort":
            finish = "abort"
        tail = []  # the chunks after the text, as objects (timings go on the last one)
        if fault == "nofinish":  # a clean end: the usage chunk and [DONE], no finish_reason
            events = events[:min(3, len(events))]
        else:
            tail.append(chunk_obj({}, finish))
        if usage and (body.get("stream_options") or {}).get("include_usage"):
            tail.append({"id": "chatcmpl-fake", "object": "chat.completion.chunk",
                         "model": body.get("model"), "choices": [], "usage": usage})
        if timings and tail:
            tail[-1]["timings"] = timings
        events += [event(obj) for obj in tail]
        events.append(f"data: [DONE]{nl}{nl}")
        if "keepalive" in modes:
            events = [e for ev in events for e in (": keep-alive" + nl + nl, ev)]

        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        cut = min(3, len(events) - 2)
        if fault in ("reset", "trunc", "stall", "errevent", "badjson"):
            for ev in events[:cut]:
                self.chunk(ev)
            if fault == "reset":
                return self.reset()
            if fault == "trunc":
                return self.hard_close()
            if fault == "stall":
                time.sleep(self.state.args.stall)
                return self.hard_close()
            if fault == "badjson":
                self.chunk('data: {"choices": [{"delta": {"content": "cut' + nl + nl)
                self.chunk("data: [DONE]" + nl + nl)
                return self.chunk(b"")
            self.chunk(event({"error": {"message": "queue full", "code": 503}}))
            return self.chunk(b"")
        if "errevent400" in modes:
            self.chunk(events[0])
            self.chunk(event({"error": {"message": "context length exceeded", "code": 400}}))
            return self.chunk(b"")
        data = "".join(events).encode()
        if crlf:
            rng = random.Random(key)
            i = 0
            while i < len(data):
                n = rng.randint(1, 7)
                self.chunk(data[i:i + n])
                i += n
                time.sleep(0.0005)
        elif "drip" in modes:
            for ev in events:
                self.chunk(ev)
                time.sleep(0.2)
        elif self.state.args.token_delay > 0:
            for ev in events:
                self.chunk(ev)
                time.sleep(self.state.args.token_delay)
        else:
            self.chunk(data)
        self.chunk(b"")


class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 1024

    def __init__(self, addr, handler):
        self.conns = set()
        self.conns_lock = threading.Lock()
        super().__init__(addr, handler)

    def handle_error(self, request, client_address):
        pass  # clients that hang up (timeouts, kill -9) are part of the tests

    def process_request_thread(self, request, client_address):
        with self.conns_lock:
            self.conns.add(request)
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self.conns_lock:
                self.conns.discard(request)

    def drop_all(self):
        with self.conns_lock:
            for c in list(self.conns):
                try:
                    c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    c.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


class Farm:
    """The chat servers: start, take one down, bring it back."""

    def __init__(self, state, n):
        self.state = state
        handler = type("H", (Handler,), {"state": state})
        self.handler = handler
        self.servers = [self.start(0) for _ in range(n)]
        self.ports = [s.server_address[1] for s in self.servers]

    def start(self, port):
        s = Server(("127.0.0.1", port), self.handler)
        threading.Thread(target=s.serve_forever, daemon=True).start()
        return s

    def down(self, index, seconds):
        s = self.servers[index]
        s.shutdown()
        s.server_close()
        s.drop_all()

        def back():
            time.sleep(seconds)
            for _ in range(100):
                try:
                    self.servers[index] = self.start(self.ports[index])
                    return
                except OSError:
                    time.sleep(0.1)
        threading.Thread(target=back, daemon=True).start()


def control_handler(farm):
    class Control(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt, *args):
            pass

        def reply(self, obj):
            data = json.dumps(obj).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            st = farm.state
            with st.lock:
                if self.path == "/requests":
                    return self.reply(st.requests)
                self.reply({"total": st.total, "attempts": st.attempts,
                            "by_fault": st.by_status, "models_requests": st.models_requests})

        def do_POST(self):
            n = int(self.headers.get("Content-Length", "0"))
            req = json.loads(self.rfile.read(n) or b"{}")
            if self.path == "/down":
                farm.down(farm.ports.index(req["port"]), req.get("seconds", 1.0))
            elif self.path == "/reset":
                with farm.state.lock:
                    farm.state.attempts.clear()
                    farm.state.requests.clear()
                    farm.state.total = 0
                    farm.state.by_status.clear()
                    farm.state.models_requests = 0
            self.reply({"ok": True})
    return Control


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--servers", type=int, default=1)
    ap.add_argument("--reasoning-field", default="reasoning_content")
    ap.add_argument("--stall", type=float, default=30.0)
    ap.add_argument("--token-delay", type=float, default=0.0, help="seconds between events")
    ap.add_argument("--chaos", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lifetime", type=float, default=600.0, help="exit after this many seconds")
    ap.add_argument("--usage", default="openai",
                    help="openai | llama | timings | none per port, comma-separated, cycled")
    ap.add_argument("--models", default="fake",
                    help="ids GET /v1/models lists: comma-separated, ';' between ports, cycled")
    ap.add_argument("--api-key", default=None, help="answer 401 without Bearer KEY")
    ap.add_argument("--forbid-key", default=None, help="answer 403 to Bearer KEY")
    args = ap.parse_args()
    kinds = args.usage.split(",")
    if any(k not in ("openai", "llama", "timings", "none") for k in kinds):
        ap.error(f"--usage: unknown kind in {args.usage!r}")
    state = State(args)
    farm = Farm(state, args.servers)
    state.usage_kind = {p: kinds[i % len(kinds)] for i, p in enumerate(farm.ports)}
    lists = [[m for m in part.split(",") if m] for part in args.models.split(";")]
    state.models = {p: lists[i % len(lists)] for i, p in enumerate(farm.ports)}
    control = Server(("127.0.0.1", 0), control_handler(farm))
    threading.Thread(target=control.serve_forever, daemon=True).start()
    print(json.dumps({"ports": farm.ports, "control": control.server_address[1]}), flush=True)
    time.sleep(args.lifetime)  # bounded: a forgotten server stops by itself


if __name__ == "__main__":
    main()
