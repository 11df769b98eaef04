"""runtime/inflight.py: a bounded queue of dispatched programs. jaxlib's CPU client deadlocks (XLA
aborts the process after 40 s) when a few dozen executions of a multi-device program with a
collective are queued; the bound keeps the loops' queues short."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from snm_jax.train.runtime.inflight import InFlight


def test_a_bounded_queue_of_collective_programs_completes_with_the_exact_values():
  """400 dispatches of an 8-device program with an all-reduce, each step's output the next one's
  input (the training loop's pattern). Unbounded, this queue aborted the process within 50 steps
  on 2 cores (jaxlib 0.10.2); through InFlight(4) it never holds more than 4 and ends on the
  values computed on the host."""
  assert jax.device_count() == 8
  mesh = jax.make_mesh((8,), ("d",))
  step = jax.jit(lambda x: (x * 0.5 + 0.5 * jnp.mean(x), jnp.sum(x)), donate_argnums=(0,))
  x = jax.device_put(jnp.arange(8 * 16, dtype=jnp.float32), NamedSharding(mesh, P("d")))
  want = np.arange(8 * 16, dtype=np.float64)
  in_flight = InFlight(4)
  for _ in range(400):
    x, total = step(x)
    in_flight.add(total)
    assert len(in_flight._outputs) <= 4  # pylint: disable=protected-access
    want = want * 0.5 + 0.5 * want.mean()
  np.testing.assert_allclose(np.asarray(x), want, rtol=1e-5)


def test_the_limit_must_be_positive():
  with pytest.raises(ValueError, match="limit must be >= 1"):
    InFlight(0)
