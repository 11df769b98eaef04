"""Typed errors raised for bad user input. Each says what was wrong and where."""


class SnmJaxError(Exception):
  """Base class of every error this library raises on purpose."""


class ConfigError(SnmJaxError, ValueError):
  """A config field has an invalid value. The message names the field (e.g. `mining.k`)."""

  def __init__(self, field: str, message: str):
    self.field = field
    super().__init__(f"config.{field}: {message}")


class DataFormatError(SnmJaxError, ValueError):
  """A data file is malformed. The message names the file and the 1-based line."""

  def __init__(self, path, line, message: str):
    self.path = str(path)
    self.line = line
    where = f"{self.path}:{line}" if line is not None else self.path
    super().__init__(f"{where}: {message}")


class DatasetNotFoundError(SnmJaxError, FileNotFoundError):
  """A named dataset is neither in the shared data folder nor in the download cache."""


class NonFiniteLossError(SnmJaxError, FloatingPointError):
  """Training produced a NaN/inf loss; the message names the step."""


class CheckpointError(SnmJaxError, RuntimeError):
  """No usable checkpoint where one is required (e.g. every checkpoint unreadable and
  `train.on_unreadable_checkpoints='fail'`). The message names the folder and each reason."""


class WorkdirInUseError(SnmJaxError, RuntimeError):
  """Another run holds the workdir's lock. The message names its pid and host."""
