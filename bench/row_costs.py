"""What one row of a batched step costs, operation by operation, on the kernels a run computes with: where the
speed-up of `--batch C` can come from on a model's own shapes, and where it cannot.

    python bench/row_costs.py [--model DIR] [--rows 1,4,16,64] [--keys 240] [--kernels auto|native|portable]

For each precision (bf16, fp32) and row count C: a decoder layer's seven matmuls (`linear` at C rows for the
model's q, k, v, o, gate, up and down shapes, summed) and the per-row attention a
batched step makes (the model's grouped-query SDPA at batch 1 over `--keys` positions, C times), in microseconds
per row. A matmul whose cost per row falls with C is where batching saves work; one whose cost per row stays flat
runs at the same rate per row at any C, and batching saves only the per-operation overhead around it. Beside them,
the same attention for C rows of one length in one call (batch C, no padding): the most any grouping of rows could
save on attention, and whether a row's output there is batch 1's bits (`same`). Under the table, for a model with
grouped K/V heads: a row's attention with its query heads packed per K/V head (transformers' `pack_gqa`, one query
row per head of a group), its cost, and in how many of `DRAWS` random inputs at each length 1..`--keys` its bits
differ from the grouped-query call's: a summation order of its own shows in a few draws only, as bf16 rounding
hides most of it, so one draw per length would not tell. With no `--model` it reads the embedded toy's shapes and,
under `--kernels auto`, runs on its portable kernels.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

DRAWS = 8
"""Random inputs at each length for the packed-heads comparison."""


def _timed(fn: Callable[[], object], rounds: int = 200) -> float:
    """Microseconds per call, after a warm-up."""
    for _ in range(10):
        fn()
    start = time.perf_counter()
    for _ in range(rounds):
        fn()
    return (time.perf_counter() - start) / rounds * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a model folder (default: the embedded toy)")
    p.add_argument("--rows", default="1,4,16,64")
    p.add_argument("--keys", type=int, default=240, help="positions each row attends over")
    p.add_argument("--kernels", default="auto")
    a = p.parse_args()

    from stagereplay.execution.kernels import choose, pin

    pin(choose(a.kernels, toy=a.model is None, device="cpu"))
    import torch
    from torch.nn.functional import linear, scaled_dot_product_attention

    from stagereplay.toy import toy_checkpoint

    config = json.loads((Path(a.model or toy_checkpoint("primary")) / "config.json").read_text())
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    dim = config.get("head_dim") or hidden // heads
    shapes = [(hidden, heads * dim), (hidden, kv_heads * dim), (hidden, kv_heads * dim), (heads * dim, hidden),
              (hidden, inter), (hidden, inter), (inter, hidden)]
    torch.set_num_threads(1)
    print(f"{Path(a.model or 'toy').name}: hidden {hidden}, MLP {inter}, {heads} heads / {kv_heads} KV heads of {dim},"
          f" {a.keys} keys; kernels {a.kernels}, 1 thread", file=sys.stderr)
    print(f"{'precision':>9} {'C':>4} {'linears us/row':>15} {'attention us/row':>17} {'in one call us/row':>19}"
          f" {'same':>5}")
    rows_list = [int(r) for r in a.rows.split(",")]
    per_row: dict[str, list[float]] = {}
    one_call: dict[str, list[float]] = {}  # attention per row in one call over one call per row
    packed: list[str] = []
    with torch.inference_mode():
        for dtype, name in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
            weights = [torch.randn(n, k, dtype=dtype) for k, n in shapes]
            q = torch.randn(1, heads, 1, dim, dtype=dtype)
            k, v = (torch.randn(1, kv_heads, a.keys, dim, dtype=dtype) for _ in range(2))
            attention = _timed(lambda: scaled_dot_product_attention(q, k, v, enable_gqa=True))  # noqa: B023
            alone = scaled_dot_product_attention(q, k, v, enable_gqa=True)
            for rows in rows_list:
                xs = [torch.randn(rows, w.shape[1], dtype=dtype) for w in weights]
                linears = sum(_timed(lambda x=x, w=w: linear(x, w)) for x, w in zip(xs, weights, strict=True))
                per_row.setdefault(name, []).append(linears / rows)
                # Row 0 is the batch-1 row; the others are other rows of the same length.
                qs = torch.cat([q, torch.randn(rows - 1, heads, 1, dim, dtype=dtype)])
                ks, vs = (torch.cat([t, torch.randn(rows - 1, kv_heads, a.keys, dim, dtype=dtype)]) for t in (k, v))
                together = _timed(lambda qs=qs, ks=ks, vs=vs: scaled_dot_product_attention(qs, ks, vs, enable_gqa=True))
                same = torch.equal(scaled_dot_product_attention(qs, ks, vs, enable_gqa=True)[:1], alone)
                one_call.setdefault(name, []).append(together / rows / attention)
                print(f"{name:>9} {rows:>4} {linears / rows:>15.1f} {attention:>17.1f} {together / rows:>19.1f}"
                      f" {'yes' if same else 'no':>5}")
            if heads > kv_heads:
                qp = q.view(1, kv_heads, heads // kv_heads, dim)
                cost = _timed(lambda qp=qp, k=k, v=v: scaled_dot_product_attention(qp, k, v))
                differ = 0
                for n in range(1, a.keys + 1):
                    for _ in range(DRAWS):
                        qn = torch.randn(1, heads, 1, dim, dtype=dtype)
                        kn, vn = (torch.randn(1, kv_heads, n, dim, dtype=dtype) for _ in range(2))
                        grouped_call = scaled_dot_product_attention(qn, kn, vn, enable_gqa=True)
                        packed_call = scaled_dot_product_attention(qn.view(1, kv_heads, -1, dim), kn, vn)
                        differ += not torch.equal(packed_call.reshape(1, heads, 1, dim), grouped_call)
                packed.append(f"{name} query heads packed: {cost:.1f} us a row against {attention:.1f}; bits differ in"
                              f" {differ} of {DRAWS * a.keys} draws")
    if packed:
        print("\n".join(packed))
    print(f"linears per row at C={rows_list[-1]} over C={rows_list[0]}: "
          + ", ".join(f"{v[-1] / v[0]:.2f} ({k})" for k, v in per_row.items())
          + f"; attention in one call over one per row at C={rows_list[-1]}: "
          + ", ".join(f"{v[-1]:.2f} ({k})" for k, v in one_call.items()))


if __name__ == "__main__":
    main()
