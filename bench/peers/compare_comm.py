"""Puts `ft comm-test --json` and comm_bench.py --json results side by side as Markdown.

    python3 bench/peers/compare_comm.py ft.json torch.json [more ft/torch pairs...]

With several pairs (repeated runs in one call), each cell is the median.
"""
import json
import statistics
import sys


def load(path):
    report = json.load(open(path))
    return {(r["op"], r["bytes"], r["dtype"]): r for r in report["rows"] if r["group"] == "world"}, report


def main(paths):
    pairs = [(load(paths[i]), load(paths[i + 1])) for i in range(0, len(paths), 2)]
    (_, ft_report), (_, torch_report) = pairs[0]
    print(f"world size {ft_report['world_size']}, backend {ft_report['backend']}, "
          f"{torch_report.get('torch', '')}, {len(pairs)} run(s) each, median shown\n")
    print("| collective | size | dtype | ft busbw GB/s | torch busbw GB/s | ft / torch |")
    print("|---|---|---|---:|---:|---:|")
    for key in pairs[0][0][0]:
        ft = statistics.median(p[0][0][key]["busbw_gbps"] for p in pairs if key in p[0][0])
        torch = statistics.median(p[1][0][key]["busbw_gbps"] for p in pairs if key in p[1][0])
        op, size, dtype = key
        print(f"| {op} | {size / 2**20:g} MiB | {dtype} | {ft:.1f} | {torch:.1f} | {ft / torch:.3f} |")


if __name__ == "__main__":
    main(sys.argv[1:])
