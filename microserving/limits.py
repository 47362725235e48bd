"""Size limits of one request on the wire, the same at every hop: the router refuses what an
engine would (so bad input never takes an engine call, a reservation on D or a send on P), and
the shim and the engine enforce them again for callers that reach them directly."""

from __future__ import annotations

MAX_REQUEST_ID_CHARS = 256
MAX_CHOICES = 16  # n
MAX_TOP_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_CACHE_SALT_CHARS = 256
