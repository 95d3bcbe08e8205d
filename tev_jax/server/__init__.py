"""``tev-jax serve``: an OpenAI-compatible server over continuous batching.

`requests` checks the request bodies, `scheduler` is the one thread that owns the
engine (slot refill, a round per lane, tokens to the streams), `app` is the Starlette
routes and server-sent events, `metrics` the Prometheus metrics under vLLM's names
(``GET /metrics``), `run` loads the models and runs uvicorn. Needs the ``serve`` extra
(starlette, uvicorn, prometheus_client): ``pip install -e ".[serve]"``; `requests` and
`scheduler` import without it.
"""
