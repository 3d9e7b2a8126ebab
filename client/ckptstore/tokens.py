"""Token management over HTTP (``/v1/tokens``, an admin token without a run pattern), for
the ``ckptstore token`` command: the operator's other way is ``ckptstore-service token``,
on the database directly (docs/security.md).

A listing is retried like any read; a creation or a revocation is not (a retried creation
would find its name taken by the first attempt).
"""

from __future__ import annotations

from urllib.parse import quote

from ckptstore.transport import Transport, UsesTransport, transport_of
from ckptstore_core.access import TokenInfo, check_run_pattern, check_scope, check_token_name

__all__ = ["create_token", "list_tokens", "revoke_token"]

_TOKENS = "/v1/tokens"
#: What the functions here send through: a transport, or what has one (a client).
Via = Transport | UsesTransport


def list_tokens(client: Via, *, revoked: bool = False) -> list[TokenInfo]:
    """The tokens in use (with ``revoked``, the revoked ones too), by id; never secrets."""
    path = _TOKENS + ("?revoked=true" if revoked else "")
    obj = transport_of(client).call("GET", path)
    return [TokenInfo.from_json(t) for t in obj["tokens"]]


def create_token(client: Via, name: str, scope: str, runs: str) -> tuple[str, TokenInfo]:
    """A new token: its secret (the only time anyone sees it) and its record. The name,
    scope and run pattern (``*`` for every run) are checked before anything is sent."""
    body = {
        "name": check_token_name(name),
        "scope": check_scope(scope),
        "runs": check_run_pattern(runs),
    }
    obj = transport_of(client).call("POST", _TOKENS, body, retried=False)
    return str(obj["token"]), TokenInfo.from_json(obj["info"])


def revoke_token(client: Via, token: str) -> TokenInfo:
    """Revoke the token of that name (or id), at once; NotFound if none is in use."""
    path = f"{_TOKENS}/{quote(token, safe='')}"
    obj = transport_of(client).call("DELETE", path, retried=False)
    return TokenInfo.from_json(obj["revoked"])
