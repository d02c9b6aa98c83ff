"""``epd up``: the whole cluster as local processes, supervised.

What lives here:

- ``command.py``: the ``epd up`` command (``add_arguments``, ``run``): checks the
  flags and ports, prepares the model, probes the children and runs the loop;
- ``supervisor.py``: starts the children, waits until they are ready, restarts
  those that exit or hang, and stops them tier by tier;
- ``spawner.py``: starts one child (``python -m services.cli <argv>``);
- ``ports.py``: every port the cluster binds, with its flag; clashes and ports
  already in use are refused before anything starts;
- ``specs.py``: ``ServiceSpec`` (how to start one child) and the children the
  flags make;
- ``flags.py``: every ``epd up`` flag, its ``--help`` groups, ``--port-offset``,
  and the restart and liveness policies the flags make;
- ``child_output.py``: each child's output, drained and forwarded, its last
  lines kept;
- ``metrics.py``: ``epd up``'s own ``/metrics``;
- ``policy.py``: when a child is restarted and when it is given up (pure).

A module imports only those below it in this list (``lint-imports`` holds the
layers: ``command``; ``supervisor``; ``spawner`` and ``ports``; ``specs``;
``flags``, ``child_output`` and ``metrics``; ``policy``), so ``ServiceSpec`` is
shared without an import circle. Outside the package they import
``services.common`` only: the encoder, PD and proxy run as child processes and
are never imported, and neither are torch and transformers, so that ``epd up``
answers at once and exits at once. This ``__init__`` imports nothing.
"""
