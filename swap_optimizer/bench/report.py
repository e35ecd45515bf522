"""The benchmark's outputs: a progress bar, the table, the JSON file, the plot."""

from __future__ import annotations

import json
import sys
from typing import Optional

MIB = 1 << 20


class Progress:
    """A one-line progress bar on stderr."""

    def __init__(self, total: int, width: int = 30, stream=sys.stderr):
        self.total, self.width, self.stream, self.done = total, width, stream, 0

    def show(self, label: str) -> None:
        filled = self.width * self.done // max(self.total, 1)
        self.stream.write(f"\r[{'#' * filled}{'.' * (self.width - filled)}] {self.done}/{self.total} {label:<40.40}")
        self.stream.flush()

    def advance(self, label: str) -> None:
        self.done += 1
        self.show(label)
        if self.done == self.total:
            self.stream.write("\n")


def _mib(value) -> str:
    return "-" if value is None else f"{value / MIB:,.1f}"


def _ms(value) -> str:
    return "-" if value is None else f"{value:,.2f}"


def _loop_cells(row: dict, resident: Optional[dict]) -> list[str]:
    ms = row.get("loop_step_ms")
    base = None if resident is None else resident.get("loop_step_ms")
    return [_ms(ms), "-" if ms is None or not base else f"{ms / base:.2f}"]


def _share(value) -> str:
    return "-" if value is None else f"{value:.1%}"


def _share_cells(row: dict, resident: Optional[dict]) -> list[str]:
    """A resident-share sweep's cells: the target and the share reached, the
    plan's predicted step() beside the measured one's ratio to resident."""
    ratio = "-" if resident is None else f"{row['step_ms'] / resident['step_ms']:.2f}"
    return [_share(row["target_share"]), _share(row.get("resident_share")), _ms(row.get("predicted_step_ms")), ratio]


def table(rows: list[dict], cpu: bool) -> str:
    """The results as a Markdown table, with ratios against the resident mode."""
    resident = next((r for r in rows if r["kind"] == "resident"), None)
    memory = "runtime accounting, MiB" if cpu else "MiB"
    header = ["mode", f"peak train ({memory})", f"peak step() ({memory})", "vs resident", "step() ms",
              "train step ms", "H2D MiB", "D2H MiB", "B/param each way", "floor ms", "step/floor",
              "step vs default", "host MiB"]
    loop = any("loop_step_ms" in r for r in rows)
    if loop:  # --overlap: whole training steps back to back, the same way for every mode
        header += ["loop train step ms", "loop vs resident"]
    sweep = any(r["target_share"] is not None for r in rows)
    if sweep:  # --resident-shares
        header += ["target share", "resident share", "predicted step() ms", "step() vs resident"]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]

    def default_of(r):  # the same batching with default (torch) state and no budget: the ratio's base
        return next((d for d in rows if d["kind"] == "swap" and d.get("state") == "default" and not d["master_weights"]
                     and d["target_share"] is None
                     and (d["swap_times"], d["num_arenas"]) == (r["swap_times"], r["num_arenas"])), None)

    for r in rows:
        ratio = "-" if resident is None else f"{r['peak_train_bytes'] / resident['peak_train_bytes']:.2f}"
        over = "-" if r["step_over_floor"] is None else f"{r['step_over_floor']:.2f}"
        per_param = r.get("bytes_per_param_each_way")
        base = default_of(r) if r["kind"] == "swap" else None
        versus = "-" if base is None else f"{r['step_ms'] / base['step_ms']:.2f}"
        lines.append("| " + " | ".join([r["mode"], _mib(r["peak_train_bytes"]), _mib(r["peak_step_bytes"]), ratio,
                                         _ms(r["step_ms"]), _ms(r["train_step_ms"]), _mib(r["h2d_bytes"]),
                                         _mib(r["d2h_bytes"]), "-" if per_param is None else f"{per_param:.2f}",
                                         _ms(r["floor_ms"]), over, versus, _mib(r["host_bytes"])]
                            + (_loop_cells(r, resident) if loop else [])
                            + (_share_cells(r, resident) if sweep else [])) + " |")
    return "\n".join(lines)


def overlap_check_costs(rows: list[dict]) -> str:
    """What overlap_forward's checks cost the forward, per overlapped mode:
    its hooks installed and idle, and a pass whose step already finished
    (every call compared with the probe's; the waits find everything ready),
    against the same forward before the optimizer existed."""
    lines = ["| overlapped mode | forward ms (device / host call) | hooks idle | vs | pass pending | vs |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        costs = r.get("forward_seconds")
        if not costs:
            continue
        plain = costs["plain"]
        cells = [f"{plain['device'] * 1e3:,.2f} / {plain['host'] * 1e3:,.2f}"]
        for key in ("hooks_idle", "pass_pending"):
            cost = costs[key]
            cells += [f"{cost['device'] * 1e3:,.2f} / {cost['host'] * 1e3:,.2f}",
                      f"{cost['device'] / plain['device']:.3f} / {cost['host'] / plain['host']:.3f}"]
        lines.append("| " + " | ".join([r["mode"]] + cells) + " |")
    return "\n".join(["forward (no grad) with overlap_forward's checks: median seconds on the device and of the host "
                      "call, against the plain forward"] + lines)


def write_json(path: str, report: dict) -> None:
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
        f.write("\n")


def write_plot(path: str, rows: list[dict], title: str) -> None:
    """Peak training memory against optimizer step time, one point per mode;
    each swap mode's PCIe floor is marked on the same memory line."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 5.5))
    for r in rows:
        y = r["peak_train_bytes"] / MIB
        marker = {"resident": "s", "swap": "o", "torchao": "^"}[r["kind"]]
        axes.scatter([r["step_ms"]], [y], marker=marker, zorder=3)
        axes.annotate(r["mode"], (r["step_ms"], y), textcoords="offset points", xytext=(5, 4), fontsize=7)
        if r["floor_ms"] is not None:
            axes.plot([r["floor_ms"], r["step_ms"]], [y, y], ":", color="grey", zorder=1)
            axes.scatter([r["floor_ms"]], [y], marker="|", color="black", s=80, zorder=2)
    axes.scatter([], [], marker="|", color="black", label="copy floor (bytes moved / measured bandwidth)")
    axes.set_xlabel("optimizer step() time, ms (median)")
    axes.set_ylabel("peak memory over a training step, MiB")
    axes.set_title(title, fontsize=9)
    axes.grid(True, alpha=0.3)
    axes.legend(loc="best", fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


LANES = ("copy in", "update", "copy out", "forward")


def write_timeline(path: str, spans: list[dict], title: str) -> None:
    """One overlapped step and the next forward: per batch its copy in, update
    and copy out, per block its forward, on a shared time axis."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    figure, axes = plt.subplots(figsize=(10, 3.8))
    colours = plt.get_cmap("tab20")
    for lane_index, lane in enumerate(LANES):
        for span in (s for s in spans if s["lane"] == lane):
            start, width = span["start"] * 1e3, max((span["end"] - span["start"]) * 1e3, 1e-3)
            axes.broken_barh([(start, width)], (lane_index - 0.4, 0.8), facecolors=colours(span["batch"] % 20),
                             edgecolor="black", linewidth=0.3)
            if width > 0.02 * max(s["end"] for s in spans) * 1e3:
                axes.text(start + width / 2, lane_index, str(span["batch"]), ha="center", va="center", fontsize=6)
    axes.set_yticks(range(len(LANES)))
    axes.set_yticklabels(["copy in (batch)", "update (batch)", "copy out (batch)", "forward (block)"])
    axes.invert_yaxis()
    axes.set_xlabel("ms after step() began")
    axes.set_title(title, fontsize=9)
    axes.grid(True, axis="x", alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
