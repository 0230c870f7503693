"""The picture of a `wus-train` run: the modes' loss curves on one axis, and the memory
each device holds, replicated beside wus.

Everything drawn is measured in the run (`loop.train`'s summaries): the training loss of
every update, the optimizer state device 0 holds (`report.bytes_per_device`) and the
compiled step's memory per device (`report.memory`: argument + output - alias + temp).
"""

import pathlib

import numpy as np

_COLORS = {"replicated": "tab:gray", "wus": "tab:blue"}
_STYLES = {"replicated": "-", "wus": "--"}
_MIB = 2 ** 20


def plot(results: dict[str, dict], path: pathlib.Path, title: str = "") -> pathlib.Path:
  """Writes the run's picture (`draw`) as PNG to `path` and returns `path`."""
  from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top
  fig = draw(results, title)
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def draw(results: dict[str, dict], title: str = ""):
  """The run's picture, a matplotlib Figure of two axes.

  Left: the training loss of each update, every mode on one axis (wus's dashed over
  replicated's solid line: equal losses draw one curve). Right: MiB per device of the
  optimizer state and of the compiled step, per mode.

  Args:
    results: {mode: `loop.train` summary} ("losses", "start_step",
      "state_bytes_per_device", and "memory" when the step was compiled).
    title: the figure's title (the model, optimizer and devices).

  Returns:
    The Figure: its first axes hold one line per mode (x: update, y: loss), its
    second one bar container per mode (optimizer state, compiled step; MiB).
  """
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top

  modes = list(results)
  fig, (loss_ax, mem_ax) = plt.subplots(1, 2, figsize=(10, 4),
                                        gridspec_kw={"width_ratios": [3, 2]})
  for mode in modes:
    r = results[mode]
    steps = r["start_step"] + 1 + np.arange(len(r["losses"]))
    loss_ax.plot(steps, r["losses"], _STYLES.get(mode, ":"), color=_COLORS.get(mode),
                 label=mode, linewidth=1.5)
  loss_ax.set_xlabel("update")
  loss_ax.set_ylabel("training loss")
  loss_ax.set_title("Training loss")
  loss_ax.legend()

  bars = {"optimizer state": lambda r: r["state_bytes_per_device"]["opt_state"],
          "compiled step": lambda r: r.get("memory", {}).get("total", 0)}
  x, width = np.arange(len(bars)), 0.8 / len(modes)
  for k, mode in enumerate(modes):
    values = [f(results[mode]) / _MIB for f in bars.values()]
    drawn = mem_ax.bar(x + (k - (len(modes) - 1) / 2) * width, values, width,
                       color=_COLORS.get(mode), label=mode)
    mem_ax.bar_label(drawn, fmt="%.1f", fontsize=8)
  mem_ax.set_xticks(x, list(bars))
  mem_ax.set_ylabel("MiB per device")
  mem_ax.set_title("Memory per device")
  mem_ax.legend()
  if title:
    fig.suptitle(title)
  fig.tight_layout()
  return fig
