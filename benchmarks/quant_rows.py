"""The quantized products alone: how fast pc_rag's kernels read each GGML format, and where decoding for oneDNN wins.

    python -m benchmarks.quant_rows                      # the 0.37B shape's MLP, 8 layers in turn, bf16
    python -m benchmarks.quant_rows --rows 1 4 8 16 32 64 --formats Q4_0 Q4_K Q6_K Q8_0 --json out.json

For each format and row count, medians of --reps (alternating): the few-rows kernel (kernels.QuantRows, straight from
the quantized bytes), and the path longer products take (weights.Quantized.product: the matrices decoded to bf16 by
the native kernel a tile at a time, then oneDNN); and for reference, bf16 weights through linear_rows (1 row) as the
float model reads them. The matrices are a layer's gate|up and down at the chosen shape, as many layers as --layers,
so that they come from memory as a decode step's do, not from the caches. GB/s is the quantized bytes read per
second. weights.QUANT_ROWS, the most rows
the kernel takes, comes from where the two paths cross here.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch

from pc_rag.model import kernels, quant, weights

SHAPES = {"large": (896, 4864), "1b": (2048, 8192)}  # hidden, MLP width (testing.SIZES)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="large", choices=sorted(SHAPES))
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--formats", nargs="+", default=["Q4_0", "Q5_0", "Q8_0", "Q4_K", "Q6_K"])
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 4, 8, 16, 32, 64])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    k = kernels.loaded()
    if k is None or not k.linear_bf16:
        raise SystemExit(f"quant_rows: the native kernels with AVX512-BF16 do not run here ({kernels.why_not()})")
    hidden, width = SHAPES[args.shape]
    g = torch.Generator().manual_seed(0)
    rows_out = []
    for name in args.formats:
        fmt = quant.BY_NAME[name]
        products, nbytes = [], 0
        for _ in range(args.layers):
            for n, cols in ((2 * width, hidden), (hidden, width)):
                if cols % fmt.weights:
                    raise SystemExit(f"{name} takes rows of a multiple of {fmt.weights}; {cols} is not")
                w = quant.quantize(torch.randn(n, cols, generator=g) * 0.02, fmt) if name in (
                    "Q8_0", "Q4_0", "Q4_K", "Q6_K") else _random(fmt, n, cols, g)
                nbytes += w.numel()
                # the runner's own product, with the kernel for a few rows, and a view of it without (tiles)
                product = weights.Quantized([quant.QuantLinear(w, fmt, cols)], None, torch.bfloat16).routed(k, 0)
                decoding = copy.copy(product)
                decoding.few = None
                products.append((product, decoding))
        for m in args.rows:
            xs = {p.k: torch.randn(m, p.k, generator=g).to(torch.bfloat16) for p, _ in products}

            def kernel(products=products, xs=xs):
                for p, _ in products:
                    p.few.run(xs[p.k])

            def decoded(products=products, xs=xs):
                for _, p in products:
                    p.product(xs[p.k])

            a, b = _alternate(kernel, decoded, args.reps)
            rows_out.append({"format": name, "rows": m, "kernel_ms": a * 1e3, "decoded_onednn_ms": b * 1e3,
                             "kernel_gbps": nbytes / a / 1e9, "bytes": nbytes})
            print(f"{name:5} {m:3} rows: kernel {a * 1e3:7.2f} ms ({nbytes / a / 1e9:5.1f} GB/s), decoded + oneDNN "
                  f"{b * 1e3:7.2f} ms", flush=True)
    floats = [kernels.LinearRows(k.linear_rows, [torch.randn(n, cols, generator=g).to(torch.bfloat16)], None)
              for _ in range(args.layers) for n, cols in ((2 * width, hidden), (hidden, width))]
    xs = {p.k: torch.randn(1, p.k, generator=g).to(torch.bfloat16) for p in floats}
    fbytes = sum(p.n * p.k * 2 for p in floats)
    t, _ = _alternate(lambda: [p.run(xs[p.k]) for p in floats], lambda: None, args.reps)
    print(f"bf16  1 row: linear_rows {t * 1e3:.2f} ms ({fbytes / t / 1e9:.1f} GB/s of bf16 weights)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": args.shape, "layers": args.layers, "threads": torch.get_num_threads(),
                       "rows": rows_out, "bf16_linear_rows_1_row_ms": t * 1e3, "bf16_bytes": fbytes}, f, indent=2)


def _random(fmt, n, cols, g) -> torch.Tensor:
    """Rows of `fmt` with random integer fields and small scales (formats pc_rag does not quantize to)."""
    raw = torch.randint(0, 256, (n, fmt.row_bytes(cols)), dtype=torch.uint8, generator=g)
    blocks = raw.view(n, -1, fmt.bytes)
    for at in (0, 2) if fmt in (quant.Q4_1, quant.Q5_1, quant.Q5_K) else (0,):
        halves = (torch.rand(blocks.shape[:2], generator=g) * 0.01).to(torch.float16)
        blocks[..., at: at + 2] = halves.view(torch.uint8).view(n, -1, 2)
    return raw


def _alternate(f, h, reps: int) -> tuple[float, float]:
    times = {f: [], h: []}
    f(), h()
    for _ in range(reps):
        for fn in (f, h):
            t0 = time.perf_counter()
            fn()
            times[fn].append(time.perf_counter() - t0)
    return statistics.median(times[f]), statistics.median(times[h])


if __name__ == "__main__":
    main()
