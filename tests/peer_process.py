"""A peer with test handlers, run as a separate process by the tests; prints its address."""

import argparse
import asyncio
import sys

import torch

from potluck.net import Identity, TCPTransport


async def echo(request, ctx):
    return request


async def sink(stream, ctx):
    """Counts the elements of the tensors streamed to it; answers the total."""
    total = 0
    async for chunk in stream:
        total += chunk.numel()
    await stream.send(total)


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--insecure", action="store_true")
    args = parser.parse_args()
    transport = TCPTransport(Identity.generate(), host="127.0.0.1", insecure=args.insecure)

    async def source(stream, ctx):
        n, size = stream.request["n"], stream.request["size"]
        for i in range(n):
            await stream.send(torch.full((size,), float(i)))
            await asyncio.sleep(stream.request.get("pause", 0))

    transport.add_handler("echo", echo)
    transport.add_stream_handler("sink", sink)
    transport.add_stream_handler("source", source)
    await transport.start()
    print(transport.addresses[0], flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        sys.exit(0)
