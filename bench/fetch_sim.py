#!/usr/bin/env python3
"""A simulated inference server (step-time model, engine admission and preemption), stdlib only.

One engine step per loop iteration; step time in ms
    t = max(a + b*B, m0 + b2*B) + c*K + p*P
(B decoding sequences, K resident KV tokens, P prefill tokens this step), with the
vllm / sglang / llamacpp admission and preemption policies of the spec.

Scaled: every length (prompt, output, max_tokens, KV capacity, prefill chunk) is divided
by `scale` (which keeps the KV knee: the same number of streams fill the cache), and
the step time is computed on the unscaled token counts, so a simulated second is
a real engine's second; the live server then runs `speed` simulated seconds per
real second. A request lives `scale` times fewer steps, so a CI-sized job has the
same number of request lifetimes as a long one in a few tens of seconds.

Two drivers of the same Engine:
  - `serve()`: an asyncio OpenAI-compatible server, one port per engine, with the
    endpoints the real servers have (vLLM /metrics; SGLang /v1/loads, /server_info,
    /metrics; llama.cpp /props, /slots), which `metrics=False` turns off (404);
  - `closed_loop()`: an ideal client at a fixed per-server concurrency in virtual
    time (no sockets, no sleeping): the sweep for the best fixed concurrency.

The workload is set by the client: each prompt's last user message carries
"[[sim:P,N]]" (prompt tokens, output tokens, already scaled), from `workload()`.
"""
import asyncio
import json
import math
import random
import re
import time
from collections import deque

PRESETS = {
    # name: policy, a, b, m0, b2, c (ms/token), p (ms/token), chunk, KV tokens
    "kimi-pcie-bf16": ("vllm", 37, 0.03, 14, 0.25, 4.0e-5, 0.06, 8192, 190000),
    "kimi-pcie-fp8": ("sglang", 37, 0.03, 14, 0.25, 2.0e-5, 0.06, 8192, 450000),
    "kimi-pcie-noP2P": ("vllm", 55, 0.03, 14, 0.25, 4.0e-5, 0.08, 8192, 190000),
    "h200-fast": ("vllm", 10, 0.05, 6, 0.12, 1.5e-5, 0.02, 8192, 700000),
    "llamacpp-8slot": ("llamacpp", 20, 2.0, 0, 0, 0, 0.3, 2048, 8 * 32768),
}
LLAMACPP_SLOTS = 8
MAX_TOKENS = 32768
SIM_RE = re.compile(r"\[\[sim:(\d+),(\d+)\]\]")


def workload(n, scale, drift=False, seed=0):
    """Per prompt (prompt tokens, output tokens), scaled, deterministic per id."""
    out = []
    for i in range(n):
        r = random.Random(seed * 1000003 + i)
        if drift and i >= n // 2 and r.random() < 0.5:
            o = r.lognormvariate(math.log(6000), 0.9)
        elif r.random() < 0.75:
            o = r.lognormvariate(math.log(700), 0.8)
        else:
            o = r.lognormvariate(math.log(3000), 1.0)
        p = min(r.lognormvariate(math.log(600), 1.0), 16384)
        o = min(o, MAX_TOKENS)
        out.append((max(1, round(p / scale)), max(1, round(o / scale))))
    return out


class Req:
    __slots__ = ("rid", "prompt", "target", "cap", "out", "kv", "todo", "state", "sink",
                 "finish", "t_arrive")

    def __init__(self, rid, prompt, target, cap, sink=None):
        self.rid, self.prompt, self.target, self.cap = rid, prompt, target, cap
        self.out = 0          # tokens generated (kept across preemptions)
        self.kv = 0           # resident KV tokens
        self.todo = 0         # prefill tokens still to compute
        self.state = "wait"   # wait | prefill | decode | done
        self.sink = sink      # live: callback(new_tokens, finish or None)
        self.finish = None
        self.t_arrive = 0.0


class Engine:
    """One server: the step model and its admission and preemption policy."""

    def __init__(self, preset, scale, name=None):
        (self.policy, self.a, self.b, self.m0, self.b2, self.c, self.p, chunk,
         kv) = PRESETS[preset]
        self.preset, self.name, self.scale = preset, name or preset, scale
        self.chunk = max(1, chunk // scale)
        self.kv_cap = max(1, kv // scale)
        self.slot_ctx = max(1, 32768 // scale)
        self.max_tokens = max(1, MAX_TOKENS // scale)
        self.reserve = max(1, 4096 // scale)
        self.slow = 1.0
        self.reset()

    def reset(self):
        self.waiting = deque()
        self.running = []  # admission order
        self.kv_used = 0
        self.steps = 0
        self.ratio = 0.7
        self.ratio_floor_step = 0  # step at which the sglang decay started
        self.retracted = False
        self.preemptions = 0
        self.gen_tokens = 0
        self.completions = 0
        self.now = 0.0       # simulated seconds
        self.busy_s = 0.0

    # ---- policies -------------------------------------------------------------------
    def add(self, req):
        req.t_arrive = self.now
        self.waiting.append(req)

    def _evict(self, r, front):
        self.kv_used -= r.kv
        r.kv, r.todo, r.state = 0, 0, "wait"
        self.running.remove(r)
        if front:
            self.waiting.appendleft(r)
        else:
            self.waiting.append(r)
        self.preemptions += 1

    def _admit(self):
        if self.policy == "llamacpp":
            while self.waiting and len(self.running) < LLAMACPP_SLOTS:
                self._start(self.waiting.popleft())
            return
        if self.policy == "vllm":
            while self.waiting and len(self.running) < 1024:
                r = self.waiting[0]
                need = r.prompt + r.out
                if need > self.kv_cap - self.kv_used:
                    break
                self._start(self.waiting.popleft())
            return
        # sglang: reserve part of every request's remaining output
        ratio = self._sglang_ratio()
        held = sum(min(r.cap - r.out, self.reserve) * ratio for r in self.running)
        while self.waiting:
            r = self.waiting[0]
            need = r.prompt + r.out + min(r.cap, self.reserve) * ratio
            if need > self.kv_cap - self.kv_used - held:
                break
            held += min(r.cap - r.out, self.reserve) * ratio
            self._start(self.waiting.popleft())

    def _sglang_ratio(self):
        if self.retracted:
            return self.ratio
        decay = max(1, 600 // self.scale)
        k = min(1.0, (self.steps - self.ratio_floor_step) / decay)
        return 0.7 + (0.098 - 0.7) * k

    def _start(self, r):
        r.kv = r.prompt + r.out  # allocated at admission; computed by prefill chunks
        r.todo = r.prompt + r.out
        self.kv_used += r.kv
        r.state = "prefill"
        self.running.append(r)

    def _make_room(self):
        """Before a decode step every decoding request needs one more KV token."""
        need = sum(1 for r in self.running if r.state == "decode")
        if self.policy == "llamacpp" or need <= self.kv_cap - self.kv_used:
            return
        if self.policy == "vllm":
            while need > self.kv_cap - self.kv_used and self.running:
                r = self.running[-1]
                if r.state == "decode":
                    need -= 1
                self._evict(r, front=True)
            return
        # sglang: retract those with the fewest outputs until free >= 20 per running
        keep = max(1.0, 20 / self.scale)
        order = sorted(self.running, key=lambda r: r.out)
        for r in order:
            if self.kv_cap - self.kv_used >= keep * len(self.running) and \
                    need <= self.kv_cap - self.kv_used:
                break
            if r.state == "decode":
                need -= 1
            self._evict(r, front=False)
        left = sum(r.cap - r.out for r in self.running) + sum(r.cap - r.out for r in self.waiting)
        outs = sum(r.out for r in self.running)
        n = len(self.running)
        self.retracted = True
        self.ratio = min(1.0, (outs + keep * n) / left) if left > 0 else 1.0

    # ---- one step -------------------------------------------------------------------
    def step(self):
        """Runs one step; returns (seconds, [(req, new_tokens, finish)])."""
        self._make_room()
        self._admit()
        if not self.running:
            return 0.0, []
        budget = self.chunk
        prefill = 0
        events = []
        decoding = [r for r in self.running if r.state == "decode"]
        for r in self.running:
            if r.state == "prefill" and budget > 0:
                n = min(r.todo, budget)
                r.todo -= n
                budget -= n
                prefill += n
                if r.todo == 0:
                    r.state = "decode"
        for r in decoding:
            r.out += 1
            r.kv += 1
            self.kv_used += 1
            fin = None
            if r.out >= min(r.target, r.cap):
                fin = "stop" if r.out >= r.target and r.out < r.cap else "length"
            elif self.policy == "llamacpp" and r.prompt + r.out >= self.slot_ctx:
                fin = "length"
            events.append((r, 1, fin))
            if fin:
                r.state, r.finish = "done", fin
        for r, _, fin in events:
            if fin:
                self.running.remove(r)
                self.kv_used -= r.kv
                r.kv = 0
                self.completions += 1
        B = len(decoding)
        s = self.scale
        t_ms = max(self.a + self.b * B, self.m0 + self.b2 * B) if self.policy != "llamacpp" \
            else self.a + self.b * B
        # K is a level (scaled down: times scale), P a flow per step (a request lives
        # scale times fewer steps, so the prefill per step is already the real one)
        t_ms += self.c * self.kv_used * s + self.p * prefill
        t = t_ms / 1000 * self.slow
        self.steps += 1
        self.gen_tokens += B
        self.now += t
        self.busy_s += t
        return t, events

    def drop_all(self):
        """A restart: every request in flight is lost; the cache is empty."""
        lost = list(self.running) + list(self.waiting)
        self.reset_keep_counters()
        return lost

    def reset_keep_counters(self):
        keep = (self.preemptions, self.gen_tokens, self.completions, self.now, self.busy_s)
        self.reset()
        (self.preemptions, self.gen_tokens, self.completions, self.now, self.busy_s) = keep

    # ---- what the server says about itself ------------------------------------------
    def n_decoding(self):
        return sum(1 for r in self.running if r.state != "wait")

    def metrics_text(self):
        if self.policy == "vllm":
            return (
                "# HELP vllm:num_requests_running Number of requests in model execution.\n"
                "# TYPE vllm:num_requests_running gauge\n"
                f'vllm:num_requests_running{{model_name="sim"}} {len(self.running)}.0\n'
                f'vllm:num_requests_waiting{{model_name="sim"}} {len(self.waiting)}.0\n'
                f'vllm:kv_cache_usage_perc{{model_name="sim"}} {self.kv_used / self.kv_cap}\n'
                f'vllm:num_preemptions_total{{model_name="sim"}} {self.preemptions}.0\n'
                f'vllm:generation_tokens_total{{model_name="sim"}} {self.gen_tokens}.0\n'
                f'vllm:cache_config_info{{block_size="16",num_gpu_blocks="{self.kv_cap // 16}"}}'
                " 1.0\n")
        if self.policy == "sglang":
            return (
                f'sglang:num_running_reqs{{model_name="sim"}} {len(self.running)}.0\n'
                f'sglang:num_queue_reqs{{model_name="sim"}} {len(self.waiting)}.0\n'
                f'sglang:token_usage{{model_name="sim"}} {self.kv_used / self.kv_cap}\n'
                f'sglang:num_retracted_reqs{{model_name="sim"}} {self.preemptions}.0\n')
        return (f"llamacpp:requests_processing {len(self.running)}\n"
                f"llamacpp:requests_deferred {len(self.waiting)}\n")

    def loads(self):
        return [{"dp_rank": 0, "num_running_reqs": len(self.running),
                 "num_waiting_reqs": len(self.waiting), "num_used_tokens": self.kv_used,
                 "max_total_num_tokens": self.kv_cap, "token_usage": self.kv_used / self.kv_cap,
                 "max_running_requests": 1024,
                 "queues": {"retracted": self.preemptions}}]


# ---- the ideal closed-loop client, in virtual time -----------------------------------

def closed_loop(presets, conc, work, scale, events=(), start_at=0):
    """Fixed per-server concurrency `conc` (a list), work handed to whichever server frees
    a slot first. `events`: [(fraction done, kind, server, arg)] with kind "slow"
    (arg: (factor, seconds)) or "restart" (arg: seconds down). Returns the
    completion log [(sim time, output tokens)] and the engines."""
    engines = [Engine(p, scale) for p in presets]
    nxt = start_at
    log = []
    inflight = [0] * len(engines)
    pending = deque()  # lost to a restart, sent again first
    down_until = [0.0] * len(engines)
    slow_until = [0.0] * len(engines)
    evs = sorted(events)
    now = 0.0
    clocks = [0.0] * len(engines)

    def feed(i):
        nonlocal nxt
        while inflight[i] < conc[i] and clocks[i] >= down_until[i]:
            if pending:
                idx = pending.popleft()
            elif nxt < len(work):
                idx, nxt = nxt, nxt + 1
            else:
                return
            p, o = work[idx]
            e = engines[i]
            e.now = clocks[i]
            e.add(Req(idx, p, o, e.max_tokens))
            inflight[i] += 1

    for i in range(len(engines)):
        feed(i)
    while len(log) < len(work):
        # advance the engine whose clock is earliest
        i = min(range(len(engines)), key=lambda k: clocks[k])
        e = engines[i]
        now = clocks[i]
        while evs and len(log) >= evs[0][0] * len(work):
            _, kind, si, arg = evs.pop(0)
            if kind == "slow":
                engines[si].slow = arg[0]
                slow_until[si] = now + arg[1]
            else:
                for r in engines[si].drop_all():
                    pending.appendleft(r.rid)
                inflight[si] = 0
                down_until[si] = now + arg
                for k in range(len(engines)):
                    if clocks[k] == float("inf") or k == si:
                        clocks[k] = now
                        feed(k)
        if slow_until[i] and now >= slow_until[i]:
            e.slow, slow_until[i] = 1.0, 0.0
        if now < down_until[i]:
            clocks[i] = down_until[i]
            continue
        feed(i)
        e.now = now
        t, evts = e.step()
        if t == 0:  # nothing to run: asleep until a restart hands back work
            clocks[i] = float("inf")
            if all(c == float("inf") for c in clocks):
                break
            continue
        clocks[i] = now + t
        for r, _, fin in evts:
            if fin:
                log.append((clocks[i], r.out))
                inflight[i] -= 1
        feed(i)
    return log, engines


def rate_10_90(log, n):
    """Completed output tokens per simulated second between 10 % and 90 % of the prompts."""
    log = sorted(log)
    if len(log) < 10:
        return 0.0
    a, b = int(0.1 * n), int(0.9 * n) - 1
    b = min(b, len(log) - 1)
    if b <= a:
        return 0.0
    toks = sum(o for _, o in log[a + 1:b + 1])
    dt = log[b][0] - log[a][0]
    return toks / dt if dt > 0 else 0.0


# ---- the live server ------------------------------------------------------------------

class Live:
    """Engines served over HTTP on a sped-up clock; one process, one asyncio loop."""

    def __init__(self, presets, scale, speed, metrics=True, total=0, events=()):
        self.engines = [Engine(p, scale, name=f"{p}#{i}") for i, p in enumerate(presets)]
        self.speed, self.metrics, self.total = speed, metrics, total
        self.events = sorted(events)
        self.wake = [None] * len(self.engines)
        self.servers = [None] * len(self.engines)
        self.ports = [0] * len(self.engines)
        self.conns = [set() for _ in self.engines]
        self.down = [False] * len(self.engines)
        self.log = []  # (sim time, output tokens, server)
        self.t0 = None
        self.rates = []  # (sim time, server, generated tokens) per step, bucketed later
        self.tasks = []
        self.completions = 0
        self.lost = 0

    def sim_now(self):
        return (time.monotonic() - self.t0) * self.speed

    async def engine_loop(self, i):
        e = self.engines[i]
        deadline = self.sim_now()
        while True:
            if self.down[i] or not (e.running or e.waiting):
                await self.wake[i].wait()
                self.wake[i].clear()
                deadline = max(deadline, self.sim_now())
                continue
            e.now = deadline
            t, evts = e.step()
            if t == 0:
                continue
            deadline += t
            for r, n, fin in evts:
                r.sink(n, fin)
                if fin:
                    self.log.append((deadline, r.out, i))
                    self.completions += 1
            self.rates.append((deadline, i, len(evts)))
            self.check_events(deadline)
            lag = (deadline - self.sim_now()) / self.speed
            if lag > 0:
                await asyncio.sleep(lag)
            elif self.engines and e.steps % 64 == 0:
                await asyncio.sleep(0)

    def check_events(self, now):
        while self.events and self.completions >= self.events[0][0] * self.total:
            _, kind, si, arg = self.events.pop(0)
            if kind == "slow":
                self.engines[si].slow = arg[0]
                asyncio.get_running_loop().call_later(arg[1] / self.speed, self.unslow, si)
            else:
                asyncio.ensure_future(self.restart(si, arg))

    def unslow(self, si):
        self.engines[si].slow = 1.0

    async def restart(self, si, seconds):
        self.down[si] = True
        self.servers[si].close()
        for w in list(self.conns[si]):
            w.transport.abort()
        lost = self.engines[si].drop_all()
        self.lost += len(lost)
        for r in lost:
            r.sink(0, "abort!")
        await asyncio.sleep(seconds / self.speed)
        await self.listen(si, self.ports[si])
        self.down[si] = False
        self.wake[si].set()

    async def listen(self, i, port=0):
        srv = await asyncio.start_server(lambda r, w: self.conn(i, r, w), "127.0.0.1", port,
                                         reuse_address=True)
        self.servers[i] = srv
        self.ports[i] = srv.sockets[0].getsockname()[1]

    async def conn(self, i, reader, writer):
        self.conns[i].add(writer)
        try:
            while True:
                line = await reader.readline()
                if not line:
                    return
                method, path, _ = line.decode("latin-1").split(" ", 2)
                length = 0
                while True:
                    h = await reader.readline()
                    if h in (b"\r\n", b"\n", b""):
                        break
                    k, _, v = h.decode("latin-1").partition(":")
                    if k.strip().lower() == "content-length":
                        length = int(v.strip())
                body = await reader.readexactly(length) if length else b""
                if not await self.route(i, method, path, body, writer):
                    return
        except (ConnectionError, asyncio.IncompleteReadError, ValueError):
            pass
        finally:
            self.conns[i].discard(writer)
            writer.close()

    def reply(self, writer, status, obj, ctype="application/json"):
        data = obj.encode() if isinstance(obj, str) else json.dumps(obj).encode()
        reason = {200: "OK", 404: "Not Found", 400: "Bad Request"}.get(status, "X")
        writer.write(f"HTTP/1.1 {status} {reason}\r\nContent-Type: {ctype}\r\n"
                     f"Content-Length: {len(data)}\r\n\r\n".encode() + data)

    async def route(self, i, method, path, body, writer):
        e = self.engines[i]
        path = path.split("?")[0]
        if method == "GET":
            if path.endswith("/models"):
                self.reply(writer, 200, {"object": "list", "data": [{"id": "sim"}]})
            elif path == "/health":
                self.reply(writer, 200, {})
            elif not self.metrics:
                self.reply(writer, 404, {"error": "not found"})
            elif path == "/metrics" and e.policy in ("vllm", "sglang"):
                self.reply(writer, 200, e.metrics_text(), "text/plain; version=0.0.4")
            elif path == "/v1/loads" and e.policy == "sglang":
                self.reply(writer, 200, e.loads())
            elif path == "/server_info" and e.policy == "sglang":
                self.reply(writer, 200, {"max_total_num_tokens": e.kv_cap})
            elif path == "/props" and e.policy == "llamacpp":
                self.reply(writer, 200, {"total_slots": LLAMACPP_SLOTS, "model_path": "sim"})
            elif path == "/slots" and e.policy == "llamacpp":
                busy = len(e.running)
                self.reply(writer, 200, [{"id": k, "is_processing": k < busy}
                                         for k in range(LLAMACPP_SLOTS)])
            else:
                self.reply(writer, 404, {"error": "not found"})
            await writer.drain()
            return True
        if not path.endswith("/chat/completions"):
            self.reply(writer, 404, {"error": "not found"})
            return True
        return await self.complete(i, json.loads(body), writer)

    async def complete(self, i, req, writer):
        e = self.engines[i]
        text = req["messages"][-1]["content"]
        m = SIM_RE.search(text if isinstance(text, str) else json.dumps(text))
        prompt, target = (int(m.group(1)), int(m.group(2))) if m else (8, 8)
        cap = min(int(req.get("max_tokens") or e.max_tokens), e.max_tokens)
        usage = (req.get("stream_options") or {}).get("include_usage")
        q = asyncio.Queue()
        r = Req(0, prompt, target, cap, sink=lambda n, fin: q.put_nowait((n, fin)))
        e.add(r)
        self.wake[i].set()
        if not req.get("stream"):  # a whole body (the fetcher's 1-token probe)
            fin = None
            while not fin:
                _, fin = await q.get()
            if fin == "abort!":
                writer.transport.abort()
                return False
            self.reply(writer, 200, {
                "object": "chat.completion", "model": "sim",
                "choices": [{"index": 0, "finish_reason": fin,
                             "message": {"role": "assistant", "content": "x " * r.out}}],
                "usage": {"prompt_tokens": prompt, "completion_tokens": r.out,
                          "total_tokens": prompt + r.out}})
            await writer.drain()
            return True
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")
        tok = b'data: {"object":"chat.completion.chunk","choices":[{"index":0,' \
              b'"delta":{"content":"x "}}]}\n\n'
        while True:
            n, fin = await q.get()
            while not q.empty() and not fin:
                n2, fin = q.get_nowait()
                n += n2
            if fin == "abort!":
                writer.transport.abort()
                return False
            out = tok * n
            if fin:
                out += ('data: {"object":"chat.completion.chunk","choices":[{"index":0,'
                        f'"delta":{{}},"finish_reason":"{fin}"}}]}}\n\n').encode()
                if usage:
                    out += ('data: {"object":"chat.completion.chunk","choices":[],"usage":'
                            f'{{"prompt_tokens":{prompt},"completion_tokens":{r.out},'
                            f'"total_tokens":{prompt + r.out}}}}}\n\n').encode()
                out += b"data: [DONE]\n\n"
            if out:
                writer.write(b"%x\r\n%s\r\n" % (len(out), out))
            if fin:
                writer.write(b"0\r\n\r\n")
                await writer.drain()
                return True
            await writer.drain()

    async def start(self):
        self.t0 = time.monotonic()
        for i in range(len(self.engines)):
            self.wake[i] = asyncio.Event()
            await self.listen(i)
            self.tasks.append(asyncio.ensure_future(self.engine_loop(i)))
        return self.ports

    def stop(self, loop):
        for t in self.tasks:
            t.cancel()
        loop.call_soon(loop.stop)
