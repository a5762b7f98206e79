#!/usr/bin/env python3
"""A fast canned OpenAI-compatible chat server for bench/fetch_bench.py.

asyncio.Protocol on raw HTTP/1.1 with keep-alive: every POST gets the same
chunked SSE stream of --tokens reasoning+content events (the request body is
skipped, not parsed), so the server costs little next to the client measured.
With --token-delay the events are spaced out, holding many streams open.
Prints {"port": P} when ready; GET /peak returns the most streams open at once.
"""
import argparse
import asyncio
import json
import resource
import sys


def sse_events(tokens):
    def ev(obj):
        return b"data: " + json.dumps(obj).encode() + b"\n\n"

    def chunk(delta, fr=None):
        return {"id": "c", "object": "chat.completion.chunk", "model": "bench",
                "choices": [{"index": 0, "delta": delta, "finish_reason": fr}]}

    out = [ev(chunk({"role": "assistant", "content": ""}))]
    half = tokens // 2
    out += [ev(chunk({"reasoning_content": f"r{i} "})) for i in range(half)]
    out += [ev(chunk({"content": f"t{i} "})) for i in range(tokens - half)]
    out.append(ev(chunk({}, "stop")))
    out.append(ev({"id": "c", "object": "chat.completion.chunk", "choices": [],
                   "usage": {"prompt_tokens": 10, "completion_tokens": tokens,
                             "total_tokens": 10 + tokens}}))
    out.append(b"data: [DONE]\n\n")
    return out


HEAD = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n")


def framed(data):
    return b"%x\r\n%s\r\n" % (len(data), data)


class Stats:
    open_streams = 0
    peak = 0
    requests = 0


class Conn(asyncio.Protocol):
    def __init__(self, events, delay):
        self.buf = b""
        self.events = events
        self.whole = HEAD + framed(b"".join(events)) + b"0\r\n\r\n"
        self.delay = delay
        self.busy = False

    def connection_made(self, transport):
        self.t = transport

    def data_received(self, data):
        self.buf += data
        self.pump()

    def pump(self):
        while not self.busy:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end].decode("latin-1")
            length = 0
            for line in head.split("\r\n")[1:]:
                k, _, v = line.partition(":")
                if k.strip().lower() == "content-length":
                    length = int(v)
            if len(self.buf) < end + 4 + length:
                return
            self.buf = self.buf[end + 4 + length:]
            Stats.requests += 1
            if head.startswith("GET /peak"):
                body = json.dumps({"peak": Stats.peak, "requests": Stats.requests}).encode()
                self.t.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            elif self.delay <= 0:
                self.t.write(self.whole)
            else:
                self.busy = True
                asyncio.get_running_loop().create_task(self.slow())

    async def slow(self):
        Stats.open_streams += 1
        Stats.peak = max(Stats.peak, Stats.open_streams)
        try:
            self.t.write(HEAD)
            for ev in self.events:
                await asyncio.sleep(self.delay)
                if self.t.is_closing():
                    return
                self.t.write(framed(ev))
            self.t.write(b"0\r\n\r\n")
        finally:
            Stats.open_streams -= 1
            self.busy = False
        self.pump()


async def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--token-delay", type=float, default=0.0)
    ap.add_argument("--lifetime", type=float, default=900)
    args = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    events = sse_events(args.tokens)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: Conn(events, args.token_delay), "127.0.0.1", 0,
                                      backlog=4096)
    print(json.dumps({"port": server.sockets[0].getsockname()[1]}), flush=True)
    await asyncio.sleep(args.lifetime)  # bounded: stops by itself


if __name__ == "__main__":
    asyncio.run(main())
