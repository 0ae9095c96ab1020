"""What a user sees during pretraining: a progress bar, a CSV, TensorBoard events and a summary.

Only rank 0 writes. Bytes are the adapters' own counters (``engine.topo_align_stats()``,
``TopoAlignDDP.topo_stats()``): the payload this rank handed to collectives on each tier, per
optimizer step. The flat reference is the payload one all-reduce of every gradient over the
data-parallel group would hand over (the fp32 gradient bytes), the same accounting, so "inter bytes
per step below flat" compares like with like. When the framework reduces gradients itself (stock
runs, `flat` mode) there are no counters and only that reference is shown, marked "(computed)".
"""

from __future__ import annotations

import csv
import json
import math
import os
import shutil
import sys
import time
from typing import Any, TextIO

__all__ = ["TrainLogger", "tier_bytes", "fmt_bytes", "fmt_count"]

CSV_FIELDS = ["step", "elapsed_s", "loss", "val_loss", "lr", "tokens_per_s", "step_time_s",
              "bytes_intra", "bytes_inter", "bytes_dp", "bytes_flat"]


def fmt_bytes(n: float | None) -> str:
    if n is None or (isinstance(n, float) and math.isnan(n)):
        return "-"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def fmt_count(n: float) -> str:
    for unit, scale in (("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{n:.0f}"


def fmt_time(s: float) -> str:
    s = int(round(s))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def tier_bytes(stats: dict | None) -> dict[str, float]:
    """Cumulative payload bytes per tier (``intra``, ``inter``, ``dp``) from the adapters' stats.

    Accepts the DeepSpeed adapter's ``{"total": {"inter/sync/bytes": n, ...}}`` and the Megatron
    adapter's ``{"totals": {class: {tier: {"bytes": n}}}}`` (both summed over classes), nested
    ``{"total": {"bytes": {tier: n | {class: n}}}}`` and the flat ``{"bytes": {tier: n}}``; tiers
    that are not reported are absent.
    """
    if not stats:
        return {}
    out: dict[str, float] = {}
    if isinstance(stats.get("totals"), dict):
        # The Megatron adapter: {"totals": {class: {tier: {"bytes": n, "seconds": s}}}}.
        for tiers in stats["totals"].values():
            for tier, v in (tiers.items() if isinstance(tiers, dict) else ()):
                if (
                    tier in ("intra", "inter", "dp")
                    and isinstance(v, dict)
                    and isinstance(v.get("bytes"), (int, float))
                ):
                    out[tier] = out.get(tier, 0.0) + float(v["bytes"])
        return out
    node: Any = stats.get("total", stats)
    if not isinstance(node, dict):
        return out
    for key, v in node.items():
        parts = str(key).split("/")
        if len(parts) >= 2 and parts[-1] == "bytes" and parts[0] in ("intra", "inter", "dp") \
                and isinstance(v, (int, float)):
            out[parts[0]] = out.get(parts[0], 0.0) + float(v)
    if out:
        return out
    if isinstance(node.get("bytes"), dict):
        node = node["bytes"]
    for tier in ("intra", "inter", "dp"):
        v = node.get(tier)
        if isinstance(v, dict):  # per class: {"sync": n, "local": n}
            v = sum(x for x in v.values() if isinstance(x, (int, float)))
        if isinstance(v, (int, float)):
            out[tier] = float(v)
    return out


class TrainLogger:
    """Progress bar (TTY: one updating line; else a line per ``log_interval``), CSV, TensorBoard.

    ``flat_bytes`` is the flat all-reduce reference per step (see module docstring).
    """

    def __init__(self, run_dir: str, *, rank: int, total_steps: int, start_step: int, tokens_per_step: int,
                 flat_bytes: float, log_interval: int = 10, tensorboard: bool = True,
                 stream: TextIO | None = None, label: str = "") -> None:
        self.active = rank == 0
        self.total_steps, self.start_step = total_steps, start_step
        self.tokens_per_step, self.flat_bytes = tokens_per_step, float(flat_bytes)
        self.log_interval = max(1, log_interval)
        self.stream = stream or sys.stdout
        self.tty = self.active and self.stream.isatty()
        self.label = label
        self.t0 = time.monotonic()
        self.train_time = 0.0
        self.first_val: float | None = None
        self.last_val: float | None = None
        self.last_loss: float | None = None
        self.val_history: list[tuple[int, float]] = []
        self._window: list[tuple[float, float]] = []  # (step_time, tokens) of recent steps
        self._bytes_prev: dict[str, float] = {}
        self._bytes_first: dict[str, float] | None = None
        self._bytes_last: dict[str, float] = {}
        self._bytes_steps = 0
        self.per_step: dict[str, float] = {}
        self._csv_fh = None
        self._tb = None
        if not self.active:
            return
        os.makedirs(run_dir, exist_ok=True)
        self.csv_path = os.path.join(run_dir, "metrics.csv")
        self._open_csv(start_step)
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                self._print("note: TensorBoard events not written: the 'tensorboard' package is not "
                            "installed (pip install topo-align[train])")
            else:
                tb_dir = os.path.join(run_dir, "tensorboard")
                if start_step == 0:
                    shutil.rmtree(tb_dir, ignore_errors=True)  # a fresh run: no curves of an older one
                # purge_step hides events a killed run wrote after the checkpoint it resumes from.
                self._tb = SummaryWriter(tb_dir, purge_step=start_step if start_step > 0 else None)

    # -- files ---------------------------------------------------------------------------------

    def _open_csv(self, start_step: int) -> None:
        rows: list[dict] = []
        if start_step > 0 and os.path.exists(self.csv_path):
            # Rows after the checkpoint belong to steps that run again: drop them.
            with open(self.csv_path, newline="", encoding="utf-8") as fh:
                rows = [r for r in csv.DictReader(fh) if r.get("step", "").isdigit() and int(r["step"]) <= start_step]
        self._csv_fh = open(self.csv_path, "w", newline="", encoding="utf-8")
        self._csv = csv.DictWriter(self._csv_fh, fieldnames=CSV_FIELDS)
        self._csv.writeheader()
        for r in rows:
            self._csv.writerow({k: r.get(k, "") for k in CSV_FIELDS})
        self._csv_fh.flush()

    def _row(self, **kw: Any) -> None:
        if self._csv_fh is None:
            return
        self._csv.writerow({k: ("" if kw.get(k) is None else kw[k]) for k in CSV_FIELDS})
        self._csv_fh.flush()

    def _print(self, line: str) -> None:
        if not self.active:
            return
        if self.tty:
            self.stream.write("\r\033[K" + line + "\n")
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    # -- events --------------------------------------------------------------------------------

    def restore(self, val_history: list) -> None:
        """Validation results of the steps before a resume, so the summary covers the whole run."""
        for step, v in val_history:
            if step <= self.start_step:
                if self.first_val is None:
                    self.first_val = float(v)
                self.last_val = float(v)
                self.val_history.append((int(step), float(v)))

    def baseline(self, stats: dict | None) -> None:
        """Reducer counters before the first step (a resumed reducer may carry earlier totals)."""
        self._bytes_prev = tier_bytes(stats)

    def step(self, step: int, loss: float, lr: float, step_time: float, stats: dict | None) -> None:
        """After optimizer step ``step`` (1-based). ``stats`` is ``reducer.stats()`` or None."""
        self.train_time += step_time
        self.last_loss = loss
        self._window.append((step_time, self.tokens_per_step))
        self._window = self._window[-20:]
        tps = sum(t for _, t in self._window) / max(sum(s for s, _ in self._window), 1e-9)
        cur = tier_bytes(stats)
        if cur:
            if self._bytes_first is None:
                self._bytes_first = dict(self._bytes_prev) if self._bytes_prev else {k: 0.0 for k in cur}
            self.per_step = {k: cur[k] - self._bytes_prev.get(k, 0.0) for k in cur}
            self._bytes_prev = cur
            self._bytes_last = cur
            self._bytes_steps += 1
        if not self.active:
            return
        row_bytes = {f"bytes_{k}": int(v) for k, v in self.per_step.items()} if cur else {}
        self._row(step=step, elapsed_s=f"{time.monotonic() - self.t0:.3f}", loss=f"{loss:.5f}", lr=f"{lr:.6g}",
                  tokens_per_s=f"{tps:.1f}", step_time_s=f"{step_time:.4f}", bytes_flat=int(self.flat_bytes),
                  **row_bytes)
        if self._tb is not None:
            self._tb.add_scalar("train/loss", loss, step)
            self._tb.add_scalar("train/lr", lr, step)
            self._tb.add_scalar("train/tokens_per_s", tps, step)
            for k, v in self.per_step.items():
                self._tb.add_scalar(f"bytes_per_step/{k}", v, step)
            self._tb.add_scalar("bytes_per_step/flat_allreduce", self.flat_bytes, step)
        line = self._bar(step, loss, tps)
        if self.tty:
            self.stream.write("\r\033[K" + line)
            self.stream.flush()
            if step == self.total_steps:
                self.stream.write("\n")
        elif step % self.log_interval == 0 or step == self.total_steps or step == self.start_step + 1:
            self._print(line)

    def _bar(self, step: int, loss: float, tps: float) -> str:
        width = 24
        done = int(width * step / max(self.total_steps, 1))
        bar = "#" * done + "." * (width - done)
        left = (self.total_steps - step) * (sum(s for s, _ in self._window) / max(len(self._window), 1))
        if self.per_step and self._bytes_first is not None:
            # Running mean: reconciliation steps carry more than the others, the mean is what counts.
            mean = {k: (v - self._bytes_first.get(k, 0.0)) / self._bytes_steps for k, v in self._bytes_last.items()}
            b = "  ".join(f"{k} {fmt_bytes(v)}" for k, v in sorted(mean.items()) if k != "dp")
            b += f" (flat {fmt_bytes(self.flat_bytes)})"
        else:
            b = f"flat {fmt_bytes(self.flat_bytes)} (computed)"
        return (f"[{bar}] {step}/{self.total_steps} loss {loss:.4f} | {fmt_count(tps)} tok/s | "
                f"bytes/step {b} | ETA {fmt_time(left)}")

    def eval(self, step: int, val_loss: float) -> None:
        if self.first_val is None:
            self.first_val = val_loss
        self.last_val = val_loss
        self.val_history.append((step, val_loss))
        if not self.active:
            return
        self._row(step=step, elapsed_s=f"{time.monotonic() - self.t0:.3f}", val_loss=f"{val_loss:.5f}")
        if self._tb is not None:
            self._tb.add_scalar("val/loss", val_loss, step)
            self._tb.flush()
        self._print(f"validation at step {step}: loss {val_loss:.4f} (ppl {math.exp(min(val_loss, 50)):.2f})")

    def note(self, line: str) -> None:
        self._print(line)

    # -- end -----------------------------------------------------------------------------------

    def summary(self, *, steps_done: int, extra: dict | None = None) -> dict:
        """Build (every rank) and print/write (rank 0) the end-of-run summary."""
        mean: dict[str, float] = {}
        if self._bytes_steps and self._bytes_first is not None:
            mean = {k: (self._bytes_last[k] - self._bytes_first.get(k, 0.0)) / self._bytes_steps
                    for k in self._bytes_last}
        s: dict[str, Any] = {
            "label": self.label,
            "steps": steps_done,
            "start_step": self.start_step,
            "final_loss": self.last_loss,
            "first_val_loss": self.first_val,
            "final_val_loss": self.last_val,
            "val_loss_drop": (1 - self.last_val / self.first_val) if self.first_val and self.last_val else None,
            "val_history": self.val_history,
            "train_time_s": round(self.train_time, 2),
            "wall_time_s": round(time.monotonic() - self.t0, 2),
            "tokens_per_s": (
                self.tokens_per_step * (steps_done - self.start_step) / self.train_time if self.train_time > 0 else None
            ),
            "bytes_per_step": mean,
            "bytes_per_step_source": "adapter counters" if mean else "none (framework's own reduction)",
            "flat_allreduce_bytes_per_step": self.flat_bytes,
            # Collectives over the whole DP group (tier "dp": agreement scalars, or a flat fallback)
            # cross the slow tier too, so they count as inter-group traffic.
            "inter_group_bytes_per_step": (mean.get("inter", 0.0) + mean.get("dp", 0.0)) if mean else None,
            "inter_vs_flat": ((mean.get("inter", 0.0) + mean.get("dp", 0.0)) / self.flat_bytes)
            if mean and self.flat_bytes
            else None,
            **(extra or {}),
        }
        if self.active:
            self._print(self._summary_text(s))
        return s

    def _summary_text(self, s: dict) -> str:
        if s["steps"] <= s["start_step"]:
            return (f"==== summary: {s['label']} ====\nnothing to do: the run already finished at step "
                    f"{s['steps']} (use a new --run-name, or more --train-steps, to train further)")
        lines = [f"==== summary: {s['label']} ====",
                 f"steps           {s['start_step']} -> {s['steps']}",
                 f"final loss      {s['final_loss']:.4f}" if s["final_loss"] is not None else "final loss      -"]
        if s["first_val_loss"] is not None:
            drop = s["val_loss_drop"] * 100 if s["val_loss_drop"] is not None else float("nan")
            lines.append(f"validation loss {s['first_val_loss']:.4f} -> {s['final_val_loss']:.4f} ({drop:.1f}% lower)")
        lines.append(f"time            {fmt_time(s['train_time_s'])} training, {fmt_time(s['wall_time_s'])} wall"
                     + (f", {fmt_count(s['tokens_per_s'])} tok/s" if s["tokens_per_s"] else ""))
        flat = s["flat_allreduce_bytes_per_step"]
        if s["bytes_per_step"]:
            lines.append("bytes per step (this rank's collective payload, mean over the run):")
            for k, v in sorted(s["bytes_per_step"].items()):
                lines.append(f"  {k:<6} {fmt_bytes(v):>10}")
            lines.append(f"  flat all-reduce {fmt_bytes(flat):>10}  (every gradient over the whole DP group)")
            if s["inter_vs_flat"] is not None:
                lines.append(f"  inter-group (inter + dp) {fmt_bytes(s['inter_group_bytes_per_step'])} = "
                             f"{s['inter_vs_flat']:.3f} x flat")
        else:
            lines.append(f"bytes per step: flat all-reduce {fmt_bytes(flat)} (computed: the framework reduced the "
                         "gradients itself, so there are no topo-align counters)")
        return "\n".join(lines)

    def close(self, summary: dict | None = None, run_dir: str | None = None) -> None:
        if not self.active:
            return
        if summary is not None and run_dir is not None:
            with open(os.path.join(run_dir, "summary.json"), "w", encoding="utf-8") as fh:
                json.dump(summary, fh, indent=2)
        if self._tb is not None:
            self._tb.close()
        if self._csv_fh is not None:
            self._csv_fh.close()
