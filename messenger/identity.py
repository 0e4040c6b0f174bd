"""Who a pull is for, proven to the source: a tenant's pull is checked by both nodes.

The data token only opens a data-port connection (HELLO, data_security.py). Every FETCH and
RDMA_PIN then names the identity it is made for (the admin ``""``, the cluster's ``SERVICE``, or
a tenant) with a proof: an HMAC of the request keyed with that identity's token, bound to the
connection's HELLO nonces (so it is good on that connection only). The source checks the proof
against its own token table and, for a tenant, scopes the keys itself (``scope_keys``): the
request names the keys as the tenant named them, and reaches that tenant's blocks and nothing
else, whatever the destination messenger did with them. A peer holding the data token alone
reads nothing on a cluster with tokens.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from dataclasses import dataclass
from typing import Mapping, Sequence

from kvstore.keys import scope_keys
from rpc.server import SERVICE

from .frames import ProtocolError

_LABEL = b"kvcache pull v1\x00"
PROOF_BYTES = 32
MAX_WHO_BYTES = 255


@dataclass(frozen=True, slots=True)
class Identity:
    """Whom the destination pulls for, and the token that proves it (b"": no tokens here)."""

    who: str
    token: bytes = b""

    @property
    def tenant(self) -> bool:
        return self.who not in ("", SERVICE)


def request_proof(token: bytes, nonces: bytes, who: str, body: bytes) -> bytes:
    return hmac.new(token, _LABEL + nonces + who.encode() + b"\x00" + body, hashlib.sha256).digest()


def pack_identity(identity: Identity, nonces: bytes, body: bytes) -> bytes:
    """The prefix a request flagged ``FLAG_IDENTITY`` carries before its keys body."""
    who = identity.who.encode()
    proof = request_proof(identity.token, nonces, identity.who, body) if identity.token else b""
    return struct.pack("<B", len(who)) + who + struct.pack("<B", len(proof)) + proof


def unpack_identity(body: bytes) -> tuple[str, bytes, bytes]:
    """(who, proof, the keys body) of a request flagged ``FLAG_IDENTITY``."""
    try:
        n = body[0]
        who = body[1 : 1 + n].decode()
        m = body[1 + n]
    except (IndexError, UnicodeDecodeError):
        raise ProtocolError("malformed identity in a request") from None
    start = 2 + n + m
    if m not in (0, PROOF_BYTES) or len(body) < start:
        raise ProtocolError("malformed identity proof in a request")
    return who, bytes(body[2 + n : start]), bytes(body[start:])


class Identities:
    """The token table (bearer token -> identity, as ``rpc.server.Auth.tokens``), for both ends:
    the destination signs its requests with it, the source checks them."""

    def __init__(self, tokens: Mapping[str, str]) -> None:
        self._tokens: dict[str, list[bytes]] = {}
        for token, who in tokens.items():
            if len(who.encode()) > MAX_WHO_BYTES:
                raise ValueError(f"identity {who!r} is longer than {MAX_WHO_BYTES} bytes")
            self._tokens.setdefault(who, []).append(token.encode())

    @property
    def enabled(self) -> bool:
        return bool(self._tokens)

    def of(self, who: str) -> Identity | None:
        """The identity to sign a pull for ``who`` with; None: this table has no token for it.
        Without tokens every pull is the admin's, unproven."""
        if not self.enabled:
            return Identity(who)
        tokens = self._tokens.get(who)
        return Identity(who, tokens[0]) if tokens else None

    def verify(self, who: str, proof: bytes, nonces: bytes, body: bytes) -> str | None:
        """None when ``proof`` shows a token of ``who``; else why not."""
        if not self.enabled:
            return None
        tokens = self._tokens.get(who)
        if not tokens:
            return "the request names an identity this source does not know"
        for token in tokens:
            if len(proof) == PROOF_BYTES and hmac.compare_digest(
                proof, request_proof(token, nonces, who, body)
            ):
                return None
        return "the request's proof of its identity is wrong"


def stored_keys(who: str, keys: Sequence[bytes]) -> list[bytes]:
    """The keys a request for ``who`` reaches: a tenant's are scoped to it."""
    if who in ("", SERVICE):
        return list(keys)
    return list(scope_keys(keys, who))
