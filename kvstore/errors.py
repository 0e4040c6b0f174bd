"""Exceptions raised to callers of the kvstore API. Each message says what to fix."""


class KVStoreError(Exception):
    """Base class for every error the store raises on bad input or exhausted resources."""


class InvalidArgument(KVStoreError):
    """Malformed key, wrong payload size or dtype, layout mismatch, bad configuration."""


class NotFound(KVStoreError):
    """Unknown key or lease."""


class FailedPrecondition(KVStoreError):
    """The request is valid but the state does not allow it (commit without allocate, ...)."""


class CapacityExhausted(KVStoreError):
    """No page can be freed because every candidate is pinned or leased."""


class BudgetShort(Exception):
    """Internal: a tier below an equal share of a budget it shares needs ``pages`` more pages;
    the caller, holding no store lock, takes them from the budget's other stores first and
    tries again."""

    def __init__(self, pages: int) -> None:
        super().__init__(f"{pages} pages short")
        self.pages = pages


class StorageError(KVStoreError):
    """The backing storage (lmdb directory, shared memory) cannot be used."""


def echo(value: str | bytes, limit: int = 64) -> str:
    """A caller's value quoted in an error message, cut short: a megabyte name must not come back
    as a megabyte message."""
    if len(value) <= limit:
        return repr(value)
    return f"{value[:limit]!r}... ({len(value)} {'bytes' if isinstance(value, bytes) else 'chars'})"
