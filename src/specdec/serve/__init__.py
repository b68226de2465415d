"""`specdec serve`: an OpenAI-compatible HTTP server over a Decoder (FastAPI + uvicorn, the `serve` extra).

protocol.py: the requests (pydantic, unknown fields refused) and OpenAI-style error bodies;
engine.py: the one interface the app submits requests through, its one-request-at-a-time worker and its
batching worker (continuous batching, batch.py);
metrics.py: the Prometheus counters; app.py: the routes and the uvicorn runner."""
