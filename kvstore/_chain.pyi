from typing_extensions import Buffer

def chain(data: Buffer, step: int, parent: Buffer, /) -> list[bytes]:
    """One 16-byte key per whole ``step``-byte block of ``data``, chained from ``parent``."""
