#!/usr/bin/env python3
"""The Python peer of `dflash fetch`: the asyncio + OpenAI SDK pattern of
SpecForge-style regeneration scripts (AsyncOpenAI, a Semaphore bounding
concurrency, gather over all prompts, streamed chat completions accumulated
into reasoning and content, one JSON line written per result)."""
import argparse
import asyncio
import json
import resource

import openai
from openai import AsyncOpenAI


async def one(client, sem, rec, args, out):
    async with sem:
        stream = await client.chat.completions.create(
            model=args.model, messages=rec["messages"], max_tokens=args.max_tokens,
            stream=True, stream_options={"include_usage": True},
            extra_body={"chat_template_kwargs": {"thinking": True}})
        reasoning, content, finish, usage = [], [], None, None
        async for chunk in stream:
            if chunk.usage:
                usage = chunk.usage.model_dump()
            if not chunk.choices:
                continue
            delta = chunk.choices[0].delta
            extra = delta.model_extra or {}
            r = extra.get("reasoning_content") or extra.get("reasoning")
            if r:
                reasoning.append(r)
            if delta.content:
                content.append(delta.content)
            if chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
        out.write(json.dumps({"id": rec["id"], "messages": rec["messages"],
                              "completion": {"role": "assistant", "reasoning": "".join(reasoning),
                                             "content": "".join(content)},
                              "finish_reason": finish, "usage": usage}) + "\n")


async def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("input")
    ap.add_argument("output")
    ap.add_argument("--server", required=True)
    ap.add_argument("--model", default="bench")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    recs = [json.loads(line) for line in open(args.input)]
    # The SDK's own HTTP client, with room for every concurrent stream.
    limits = openai._constants.DEFAULT_CONNECTION_LIMITS.__class__(
        max_connections=args.concurrency, max_keepalive_connections=args.concurrency)
    client = AsyncOpenAI(base_url=args.server, api_key="none", max_retries=2,
                         http_client=openai.DefaultAsyncHttpxClient(limits=limits, timeout=600))
    sem = asyncio.Semaphore(args.concurrency)
    with open(args.output, "w") as out:
        await asyncio.gather(*(one(client, sem, r, args, out) for r in recs))


if __name__ == "__main__":
    asyncio.run(main())
