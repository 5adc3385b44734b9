"""An OpenAI-compatible HTTP server over chunkwise.Engine: `python -m chunkwise serve --model M`.

One file per job: `protocol.py` (request models with OpenAI's fields, the error object, response shapes),
`stops.py` (stop strings cut from streamed text), `engine_loop.py` (the engine stepped on a thread of its own,
its outputs handed to each request's asyncio queue), `metrics.py` (Prometheus), `app.py` (the FastAPI routes),
`cli.py` (the command line and uvicorn, with Ctrl-C / SIGTERM aborting in-flight requests).
"""
