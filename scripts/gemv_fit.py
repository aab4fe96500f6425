"""Fit each kernel's times in gemv_times.py tables as a fixed part plus a rate: µs = a + bytes / rate.

Reads the `| tag | layer | NxK | M=m | config | t µs | B MB | r TB/s |` rows of one or more tables (stdin or files),
groups them by config with the error and split count taken out, and prints a least-squares line per group over
its shapes. The fixed part is what a launch costs beyond its bytes (start, drain, launch gap); the rate, the
stream's bandwidth once running. Usage: python scripts/gemv_fit.py docs/gemv-times-*.md
"""
import fileinput
import re

ROW = re.compile(r"^\|[^|]*\|\s*(\S+)\s*\|[^|]*\|\s*M=(\d+)\s*\|\s*(.*?)\s*\|\s*([\d.]+) µs\s*\|\s*([\d.]+) MB\s*\|")


def kernel_name(config: str) -> str:
    """The config with what varies per shape (error, split count) taken out."""
    return re.sub(r"\s+", " ", re.sub(r"\(error [^)]*\)|splits \d+", "", config)).strip()


def fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares of µs = a + MB * b over (MB, µs) points: (a in µs, rate in TB/s)."""
    n = len(points)
    mx, my = sum(p[0] for p in points) / n, sum(p[1] for p in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    b = sum((x - mx) * (y - my) for x, y in points) / sxx
    return my - b * mx, 1 / b  # (MB / µs = TB/s)


def main():
    groups: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for line in fileinput.input():
        m = ROW.match(line)
        if m:
            _, rows, config, us, mb = m.groups()
            groups.setdefault((kernel_name(config), int(rows)), []).append((float(mb), float(us)))
    print("| kernel | M | shapes | fixed µs | TB/s | worst residual µs |")
    print("| --- | --- | --- | --- | --- | --- |")
    for (name, rows), points in groups.items():
        if len({x for x, _ in points}) < 2:
            continue  # (one size: no line)
        a, rate = fit(points)
        worst = max(abs(y - a - x / rate) for x, y in points)
        print(f"| {name} | {rows} | {len(points)} | {a:.2f} | {rate:.2f} | {worst:.2f} |")


if __name__ == "__main__":
    main()
