"""The user-facing front-ends over MosaicEngine: an OpenAI-compatible HTTP server (app.py,
worker.py, protocol.py, metrics.py, server.py), a terminal chat (chat.py), a benchmark command
(bench.py) and their CLI wiring (commands.py). docs/SERVING.md describes them.

The server's modules need the optional `serve` extra (fastapi, uvicorn, prometheus-client);
stream.py, worker.py, chat.py, bench.py and commands.py need only the engine's dependencies."""
