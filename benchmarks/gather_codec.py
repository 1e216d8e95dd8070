"""CPU time of one quantized gather's encode and decode (``flat/_transport.py``) for a
GPT block's flat group (``--dim`` wide, int8 with row scales), at F = 2 and F = 8, in this
process, one thread: what each gather adds on top of its all-gather.

    python benchmarks/gather_codec.py --dim 512

Run it under two trees (``PYTHONPATH=<tree>/src``) to compare commits.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from functools import partial

import torch

from flatshard.testing.internals import GatherCodec, row_layout


def _ms(call: Callable[[], object], repeats: int) -> float:
    for _ in range(3):
        call()
    start = time.perf_counter()
    for _ in range(repeats):
        call()
    return (time.perf_counter() - start) / repeats * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    d = args.dim
    attention = [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,)]
    mlp = [(d,), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,)]
    shapes = [torch.Size(s) for s in [*attention, *mlp]]
    for factor in (2, 8):
        layout = row_layout(shapes, factor)
        chunk = layout.shard_numel
        full = torch.randn(layout.unsharded_numel)
        codecs = [GatherCodec(layout, r, torch.int8) for r in range(factor)]
        shards = [full[r * chunk : (r + 1) * chunk] for r in range(factor)]
        gathered = torch.cat([c.encode(shards[r], torch.float32) for r, c in enumerate(codecs)])
        unsharded = torch.empty(layout.unsharded_numel)
        decode = _ms(partial(codecs[0].decode, gathered, unsharded), args.repeats)
        encode = _ms(partial(codecs[0].encode, shards[0], torch.float32), args.repeats)
        print(f"F={factor}: decode {decode:.2f} ms, encode {encode:.2f} ms")


if __name__ == "__main__":
    main()
