"""DSpark Serve: confidence-scheduled speculative decoding engine and server."""

import os

__version__ = "0.1.0"

# libgomp (torch's OpenMP) reads this when torch loads it. Its workers spin 300,000 rounds at a
# barrier before sleeping, burning the core the engine thread needs whenever anything else runs on
# the machine (a server's event loop, its HTTP proxy, a load generator): on 2 busy cores a bf16
# matmul took 17-35x longer than with 20,000 rounds, which cost nothing on an idle machine.
OPENMP_ENV = {"GOMP_SPINCOUNT": "20000"}
for _name, _value in OPENMP_ENV.items():
    os.environ.setdefault(_name, _value)
