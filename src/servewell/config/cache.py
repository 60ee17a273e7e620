"""The response cache of one model (`cache:` in model.yaml; engine/response_cache.py serves it)."""

from __future__ import annotations

from pydantic import Field

from servewell.config.strict import StrictModel

#: Most bytes one model's cache may hold. The cache lives in the engine process, outside the
#: models' memory budget: 64 GiB is more than any one host should give to cached answers.
MAX_CACHE_BYTES = 64 << 30
#: Longest a cached answer is kept: a week. Past that an answer is stale for any model version.
MAX_TTL_S = 7 * 24 * 3600.0


class ResponseCacheConfig(StrictModel):
    """Answers kept by the hash of their inputs, so a repeated request is answered without compute."""

    max_bytes: int = Field(ge=1024, le=MAX_CACHE_BYTES, description=(
        "Bytes of engine memory the cached answers may take, counted as they really hold it (arrays, "
        "their headers and the cache's own records); least recently used dropped first. An answer larger "
        "than a quarter of this is not cached."))
    ttl_s: float = Field(300.0, gt=0, le=MAX_TTL_S, description="Seconds a cached answer is served after it was "
                         "computed.")
    shared_across_tenants: bool = Field(False, description=(
        "Share cached answers and in-flight computations among all tenants (API keys' tenants) instead of "
        "keeping one cache per tenant. A tenant can then learn what another sent: a hit (`Server-Timing: "
        "cache;desc=hit`, and a fast answer) tells it that someone already sent these exact inputs. Only for "
        "models whose inputs are not private to a tenant."))
