"""A bound on how far the host dispatches programs ahead of the devices.

JAX dispatches a jitted step asynchronously, so a training loop whose host work is quicker than
the step queues up steps without limit until something reads a result. Two reasons not to:
every queued step holds its batch in device memory, and jaxlib's CPU client (0.10.2) deadlocks
when several dozen executions of a multi-device program with collectives are queued: their
per-device parts wait in a fixed thread pool for rendezvous that the queued parts behind them
can no longer join, and XLA aborts the process after 40 s ("Termination timeout for `all reduce
RendezvousKey...` exceeded"; seen with 8 forced CPU devices from about 40 queued steps of a
program with a psum, and in the suite's serial candidate groups, which queue every member's
step between two evaluations). We found no JAX or XLA option that bounds the queue on CPU,
hence this class.

`InFlight(limit)`: after dispatching a program, `add` one of its (never donated) outputs; once
more than `limit` are outstanding, `add` waits for the oldest. A few steps ahead keep the device
busy while the host prepares the next batches.
"""

from __future__ import annotations

import collections

import jax

DEFAULT_LIMIT = 4


class InFlight:
  def __init__(self, limit: int = DEFAULT_LIMIT):
    if limit < 1:
      raise ValueError(f"InFlight limit must be >= 1, got {limit}")
    self.limit = limit
    self._outputs = collections.deque()

  def add(self, output) -> None:
    """`output`: a pytree of arrays from the program just dispatched (one that no later program
    donates, e.g. the step's metrics)."""
    self._outputs.append(output)
    while len(self._outputs) > self.limit:
      jax.block_until_ready(self._outputs.popleft())
