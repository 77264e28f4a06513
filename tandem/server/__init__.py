"""tandem's OpenAI-compatible HTTP server: `tandem serve`.

api.py (FastAPI app, never runs the model), engine_client.py (the engine-core process and the asyncio client),
data_parallel.py (N cores behind a router), ray_cores.py (cores as Ray actors), protocol.py (request / response
bodies), metrics.py (Prometheus), cli.py (argparse subcommands).
Nothing heavy is imported here: `tandem.server.cli` must stay cheap to import.
"""

from __future__ import annotations
