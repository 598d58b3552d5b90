"""Draw the headline benchmark plot (one PNG) from the JSON files the benchmarks write.

Usage: python scripts/plot_benchmarks.py -o docs/benchmarks.png OUT/bench_prefill.json OUT/bench_decode.json
       [OUT/bench_quant.json OUT/bench_sparse.json ...]

Each file's kind is recognised by its contents (files of other benchmarks are skipped); one panel
per kind found, two a row, in this order:

- prefill (bench_prefill.py): TFLOP/s against sequence length for pyattn, torch SDPA FA2 and cuDNN,
  at the largest head dim measured in bf16 (else fp16), non-causal solid and causal dashed, with
  the run's matmul ceiling;
- decode (bench_decode.py): TB/s of KV read against batch x context for pyattn (page-16 cache),
  FA2 and cuDNN (the same GQA bytes over their time), with the run's device copy ceiling;
- 8-bit KV cache (bench_quant.py): speed-up of int8 / fp8 caches over the bf16 cache, with the
  bytes-read ideal (1.94x);
- block-sparse (bench_sparse.py): speed-up over pyattn's dense kernel against the fraction of
  (row, key) pairs computed, with the ideal 1 / fraction.

Needs matplotlib (``pip install matplotlib``); no GPU, no pyattn import.
"""

from __future__ import annotations

import argparse
import json
import sys

KINDS = ("prefill", "decode", "quant", "sparse")
COLORS = {"pyattn": "#d62728", "fa2": "#1f77b4", "cudnn": "#2ca02c"}
LABELS = {"pyattn": "pyattn", "fa2": "torch SDPA FA2", "cudnn": "torch SDPA cuDNN"}


def kind_of(data: dict) -> str | None:
    """Which benchmark wrote ``data``: one of KINDS, or None."""
    if "configs" in data and "ceilings" in data:
        return "prefill"
    if "rows" in data and any("layout" in r for r in data["rows"]):
        return "decode"
    if "speed" in data:
        return "quant"
    if "block_rows" in data:
        return "sparse"
    return None


def _seq(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def plot_prefill(ax, data: dict) -> None:
    rows = [r for r in data["configs"] if r.get("pyattn_tflops")]
    dtype = "bfloat16" if any(r["dtype"] == "bfloat16" for r in rows) else "float16"
    dims = {r["head_dim"] for r in rows if r["dtype"] == dtype}
    d = 128 if 128 in dims else max(dims, default=None)  # the headline head dim (bench_prefill adds 256 points)
    rows = sorted((r for r in rows if r["dtype"] == dtype and r["head_dim"] == d), key=lambda r: r["seqlen"])
    for who in ("pyattn", "fa2", "cudnn"):
        for causal, ls in ((False, "-"), (True, "--")):
            pts = [(r["seqlen"], r[f"{who}_tflops"]) for r in rows if r["causal"] == causal and r.get(f"{who}_tflops")]
            if pts:
                ax.plot(*zip(*pts), ls, marker="o", color=COLORS[who], label=None if causal else LABELS[who])
    ax.plot([], [], "k--", label="dashed: causal")
    mm = data.get("ceilings", {}).get(f"matmul_{dtype}_tflops")
    if mm:
        ax.axhline(mm, color="k", lw=0.8, ls=":", label=f"{dtype} matmul ceiling")
    seqs = sorted({r["seqlen"] for r in rows})
    ax.set_xscale("log", base=2)
    ax.set_xticks(seqs, [_seq(s) for s in seqs])
    ax.set_ylim(bottom=0)
    ax.set(xlabel="sequence length", ylabel="TFLOP/s",
           title=f"prefill forward, {'bf16' if dtype == 'bfloat16' else 'fp16'}, head dim {d}\n"
                 f"batch x seq = 16k tokens, 2048 hidden")


def plot_decode(ax, data: dict) -> None:
    rows = [r for r in data["rows"] if r.get("layout") == "p16" and r.get("kv_bytes")]
    rows.sort(key=lambda r: (r["ctx"], r["batch"]))
    x = range(len(rows))
    width = 0.27
    for i, who in enumerate(("pyattn", "fa2", "cudnn")):
        tbs = [r["kv_bytes"] / r[f"{who}_us"] / 1e6 if r.get(f"{who}_us") else 0.0 for r in rows]
        ax.bar([j + (i - 1) * width for j in x], tbs, width, color=COLORS[who], label=LABELS[who])
    copy = data.get("copy_gbs")
    if copy:
        ax.axhline(copy / 1e3, color="k", lw=0.8, ls=":", label="device copy ceiling")
    ax.set_xticks(list(x), [f"B{r['batch']}\n{_seq(r['ctx'])}" for r in rows])
    ax.set(xlabel="batch, context", ylabel="TB/s of KV read",
           title="decode over a paged KV cache (page 16)\nbf16, Hq 32, Hkv 8, D 128, q_len 1")


def plot_quant(ax, data: dict) -> None:
    rows = [r for r in data["speed"] if r.get("x_bf16") and r.get("cache") != "bf16"]
    shapes = sorted({(r["ctx"], r["batch"]) for r in rows})
    kinds = [k for k in ("int8", "fp8") if any(r["cache"] == k for r in rows)]
    for i, k in enumerate(kinds):
        xs = {(r["ctx"], r["batch"]): r["x_bf16"] for r in rows if r["cache"] == k}
        ax.bar([j + (i - (len(kinds) - 1) / 2) * 0.38 for j in range(len(shapes))], [xs.get(s, 0) for s in shapes],
               0.38, label=f"{k} cache")
    ax.axhline(1.94, color="k", lw=0.8, ls=":", label="bytes-read ideal (1.94x)")
    ax.axhline(1.0, color="grey", lw=0.6)
    ax.set_xticks(range(len(shapes)), [f"B{b}\n{_seq(c)}" for c, b in shapes])
    ax.set(xlabel="batch, context", ylabel="speed-up over the bf16 cache", title="8-bit KV cache decode")


def plot_sparse(ax, data: dict) -> None:
    rows = [r for r in data["block_rows"] if r.get("kind") == "sparse" and r.get("x_pyattn") and not r["causal"]]
    for block in sorted({r["block"] for r in rows}):
        pts = sorted((r["visible_pct"] / 100, r["x_pyattn"]) for r in rows if r["block"] == block
                     and r["case"].startswith("random"))
        if pts:
            ax.plot(*zip(*pts), marker="o", label=f"blocks {block}")
    fr = [f / 100 for f in (3, 5, 10, 20, 50, 100)]
    ax.plot(fr, [1 / f for f in fr], color="k", lw=0.8, ls=":", label="ideal (1 / fraction)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set(xlabel="fraction of (row, key) pairs computed", ylabel="speed-up over dense pyattn",
           title=f"block-sparse attention, seq {data.get('args', {}).get('seqlen', '?')}, random layouts")


PLOTS = {"prefill": plot_prefill, "decode": plot_decode, "quant": plot_quant, "sparse": plot_sparse}


def load(paths) -> dict:
    """{kind: data} of the files given (the last file of a kind wins); unknown files are reported."""
    found = {}
    for p in paths:
        try:
            with open(p) as f:
                data = json.load(f)
        except (OSError, ValueError) as exc:
            print(f"skipping {p}: {exc}")
            continue
        kind = kind_of(data) if isinstance(data, dict) else None
        if kind is None:
            print(f"skipping {p}: not a prefill, decode, 8-bit cache or sparse benchmark's JSON")
        else:
            found[kind] = data
    return found


def caption(found: dict) -> str:
    env = next((d["environment"] for d in found.values() if isinstance(d.get("environment"), dict)), {})
    parts = [env.get("gpu"), f"pyattn {env['pyattn']}" if env.get("pyattn") else None,
             f"torch {env['versions']['torch']}" if env.get("versions", {}).get("torch") else None,
             (env.get("date") or "")[:10] or None]
    return ", ".join(p for p in parts if p)


def draw(found: dict, out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    kinds = [k for k in KINDS if k in found]
    cols = min(2, len(kinds))  # two panels a row: readable at README width
    rows = -(-len(kinds) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.2 * cols, 4.6 * rows), squeeze=False)
    for ax, kind in zip(axes.flat, kinds):
        PLOTS[kind](ax, found[kind])
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(kinds):]:
        ax.set_visible(False)
    fig.suptitle(f"pyattn benchmarks: {caption(found)}", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__.split("\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("json", nargs="+", help="JSON files written by the benchmarks' --json")
    p.add_argument("-o", "--output", required=True, help="the PNG to write")
    args = p.parse_args(argv)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("plot_benchmarks.py needs matplotlib: pip install matplotlib", file=sys.stderr)
        return 2
    found = load(args.json)
    if not found:
        print("nothing to plot: none of the files is a prefill, decode, 8-bit cache or sparse benchmark's JSON",
              file=sys.stderr)
        return 1
    draw(found, args.output)
    print(f"wrote {args.output} ({', '.join(k for k in KINDS if k in found)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
