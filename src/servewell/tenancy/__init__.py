"""Who is calling: API keys and the tenants they belong to, as both `api` and `engine` know them.

`keys`: the keys file's entries (`ApiKey`), the keys in force (`KeyRing`), parsing and checking
them, and the tenant policies they state (`policies_of`). `policy`: a tenant's weight and quotas
(`TenantPolicy`), the tenant id rules and the anonymous tenant. The HTTP side (reading a key from
a request's headers, the 401 challenge, the middleware) stays in `api` (api/keys.py,
api/key_middleware.py); enforcing the quotas stays in the engine (engine/tenants.py).

Imports nothing of ours but `config`, `errors` and `observability` (tests/unit/test_import_rules.py),
so the engine reads the keys without importing `api`.
"""
