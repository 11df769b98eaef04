"""Metric outputs of a run (process 0 only): a progress line via absl logging,
`metrics.jsonl`, TensorBoard event files, and JSON files in the workdir."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

from absl import logging

from snm_jax.train.host import is_writer


def tensorboard_tag(name: str) -> str:
  """A metric name as a legal TensorBoard tag: `eval/P@1` -> `eval/P_at_1`
  (TensorBoard allows only [A-Za-z0-9_./-]; metrics.jsonl keeps the plain names)."""
  return re.sub(r"[^A-Za-z0-9_./-]", "_", name.replace("@", "_at_"))


class MetricWriter:
  def __init__(self, workdir, total_steps: int, batch_size: int):
    self.workdir = Path(workdir)
    self.total_steps, self.batch_size = total_steps, batch_size
    self.enabled = is_writer()
    self._tb = None
    self._jsonl = None
    if self.enabled:
      self.workdir.mkdir(parents=True, exist_ok=True)
      self._jsonl = open(self.workdir / "metrics.jsonl", "a", encoding="utf-8")
      try:
        from tensorboardX import SummaryWriter  # pylint: disable=g-import-not-at-top
        self._tb = SummaryWriter(str(self.workdir / "tensorboard"))
      except ImportError:  # optional: jsonl is the canonical record
        logging.warning("tensorboardX not installed: TensorBoard events are not written")
    self._last_time = None
    self._last_step = None

  def truncate_after(self, step: int) -> None:
    """Drops metrics.jsonl rows of steps > `step`: a run resumed from `step`
    writes them again, and each step must appear once."""
    if not self.enabled:
      return
    self._jsonl.close()
    path = self.workdir / "metrics.jsonl"
    rows = [line for line in path.read_text(encoding="utf-8").splitlines(keepends=True)
            if line.strip() and json.loads(line)["step"] <= step]
    path.write_text("".join(rows), encoding="utf-8")
    self._jsonl = open(path, "a", encoding="utf-8")

  def write_scalars(self, step: int, scalars: dict, wall: float) -> None:
    if not self.enabled:
      return
    record = {"step": step, "wall_time": wall, **scalars}
    self._jsonl.write(json.dumps(record) + "\n")
    self._jsonl.flush()
    if self._tb is not None:
      for k, v in scalars.items():
        if isinstance(v, (int, float)):
          self._tb.add_scalar(tensorboard_tag(k), v, step)

  def progress(self, step: int, scalars: dict) -> None:
    """The progress line: step, steps/s, examples/s, ETA, loss."""
    now = time.perf_counter()
    if self._last_time is not None and step > self._last_step:
      sps = (step - self._last_step) / (now - self._last_time)
      eta = (self.total_steps - step) / max(sps, 1e-9)
      scalars = {**scalars, "steps_per_sec": sps, "examples_per_sec": sps * self.batch_size}
      if self.enabled:
        logging.info("step %d/%d | %.1f steps/s | %.0f ex/s | ETA %.0fs | loss %.4f",
                     step, self.total_steps, sps, sps * self.batch_size, eta, scalars.get("loss", float("nan")))
    self._last_time, self._last_step = now, step
    return scalars

  def write_json(self, name: str, obj) -> None:
    if self.enabled:
      with open(self.workdir / name, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=True)

  def close(self) -> None:
    if self._jsonl is not None:
      self._jsonl.close()
    if self._tb is not None:
      self._tb.close()
