"""The OpenAI-compatible HTTP server (`pagellm serve`).

Only `cli_args` may be imported without the `server` extra (fastapi, uvicorn,
prometheus_client); everything else here needs it.
"""
