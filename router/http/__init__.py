"""The OpenAI-compatible HTTP front end: routes, request models and limits, prompts and chat
templates, streaming, errors, metrics, the server and its connection guard. It talks to a
Backend (router/backend.py) and knows nothing of nodes. Import from the modules."""
