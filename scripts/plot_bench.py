"""Plot total decode tok/s against batch size, with the roofline, from scripts/bench.py's JSON (as SVG).

    python scripts/plot_bench.py docs/bench.json docs/bench-batch.svg

One solid line per (model, prompt length): fastqwen's total tok/s (per-sequence speed × batch); a dashed line
of the same colour: the roofline at the same bytes per step (bandwidth / step bytes × batch). Log2 batch
axis, linear tok/s axis. Plain SVG, no plotting library needed.
"""

import json
import math
import pathlib
import sys

W, H, LEFT, RIGHT, TOP, BOTTOM = 720, 440, 70, 220, 30, 50
COLOURS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"]


def series(results: list[dict]) -> dict:
    """{(model, prompt): [(batch, fastqwen total tok/s, roofline total tok/s)]} sorted by batch."""
    out = {}
    for r in results:
        fq = r.get("systems", {}).get("fastqwen", {}).get("tok_s")
        if fq is None or "roofline_tok_s" not in r:
            continue
        b = r["batch_size"]
        out.setdefault((r["model"], r["prompt_len"]), []).append((b, fq * b, r["roofline_tok_s"] * b))
    return {k: sorted(v) for k, v in out.items()}


def svg(lines: dict, title: str) -> str:
    batches = sorted({b for pts in lines.values() for b, _, _ in pts})
    top = max(max(f, r) for pts in lines.values() for _, f, r in pts) * 1.05
    lo, hi = math.log2(batches[0]), max(math.log2(batches[-1]), math.log2(batches[0]) + 1)
    x = lambda b: LEFT + (math.log2(b) - lo) / (hi - lo) * (W - LEFT - RIGHT)  # noqa: E731
    y = lambda v: H - BOTTOM - v / top * (H - TOP - BOTTOM)  # noqa: E731
    el = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" '
          f'font-size="12"><rect width="{W}" height="{H}" fill="white"/>',
          f'<text x="{LEFT}" y="18" font-size="14">{title}</text>',
          f'<line x1="{LEFT}" y1="{H - BOTTOM}" x2="{W - RIGHT}" y2="{H - BOTTOM}" stroke="black"/>',
          f'<line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{H - BOTTOM}" stroke="black"/>',
          f'<text x="{(LEFT + W - RIGHT) / 2}" y="{H - 12}" text-anchor="middle">batch size</text>',
          f'<text x="16" y="{(TOP + H - BOTTOM) / 2}" transform="rotate(-90 16 {(TOP + H - BOTTOM) / 2})" '
          f'text-anchor="middle">total tokens/s</text>']
    for b in batches:
        el.append(f'<text x="{x(b)}" y="{H - BOTTOM + 16}" text-anchor="middle">{b}</text>')
    for i in range(6):
        v = top * i / 5
        el.append(f'<text x="{LEFT - 6}" y="{y(v) + 4}" text-anchor="end">{v:.0f}</text>')
        el.append(f'<line x1="{LEFT}" y1="{y(v)}" x2="{W - RIGHT}" y2="{y(v)}" stroke="#ddd"/>')
    for n, ((model, prompt), pts) in enumerate(lines.items()):
        c = COLOURS[n % len(COLOURS)]
        for idx, dash in ((1, ""), (2, ' stroke-dasharray="6 4"')):
            path = " ".join(f"{x(p[0]):.1f},{y(p[idx]):.1f}" for p in pts)
            el.append(f'<polyline points="{path}" fill="none" stroke="{c}" stroke-width="2"{dash}/>')
        for p in pts:
            el.append(f'<circle cx="{x(p[0]):.1f}" cy="{y(p[1]):.1f}" r="3" fill="{c}"/>')
        ly = TOP + 10 + 34 * n
        el.append(f'<line x1="{W - RIGHT + 12}" y1="{ly}" x2="{W - RIGHT + 36}" y2="{ly}" stroke="{c}" '
                  f'stroke-width="2"/><text x="{W - RIGHT + 42}" y="{ly + 4}">{model}, prompt {prompt}</text>')
        el.append(f'<line x1="{W - RIGHT + 12}" y1="{ly + 14}" x2="{W - RIGHT + 36}" y2="{ly + 14}" stroke="{c}" '
                  f'stroke-width="2" stroke-dasharray="6 4"/><text x="{W - RIGHT + 42}" y="{ly + 18}">roofline</text>')
    el.append("</svg>")
    return "\n".join(el)


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    data = json.loads(pathlib.Path(sys.argv[1]).read_text())
    lines = series(data["results"])
    if not lines:
        sys.exit(f"{sys.argv[1]} holds no fastqwen results to plot")
    env = data.get("environment", {})
    title = f"fastqwen decode, {env.get('hardware', '?')}, torch {env.get('torch', '?')}, {env.get('date', '')[:10]}"
    pathlib.Path(sys.argv[2]).write_text(svg(lines, title))


if __name__ == "__main__":
    main()
