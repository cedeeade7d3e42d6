"""API keys at both edges: a constant-time comparison, one rule.

With `router.api_key` set, every API call must present `Bearer <key>` (HTTP header
`Authorization`, gRPC metadata `authorization`); `/metrics` and the detailed `/health` too. A bare
liveness answer (`/health` without the key) stays open for load balancers and probes.
"""

from __future__ import annotations

import hmac


def authorized(api_key: str | None, presented: str | None) -> bool:
    """Whether `presented` (the Authorization value) carries the key; always, with no key."""
    if not api_key:
        return True
    expected = f"Bearer {api_key}".encode()
    return hmac.compare_digest((presented or "").encode(), expected)
