"""Storage tiers, fastest first."""

from enum import IntEnum


class Tier(IntEnum):
    GPU = 0
    DRAM = 1
    SSD = 2

    @classmethod
    def parse(cls, name: "str | int | Tier") -> "Tier":
        if isinstance(name, Tier):
            return name
        if isinstance(name, int):
            return cls(name)
        try:
            return cls[name.upper()]
        except KeyError:
            raise ValueError(f"unknown tier {name!r}; expected one of gpu, dram, ssd") from None


TIER_OF = (Tier.GPU, Tier.DRAM, Tier.SSD)  # by tier number, without an enum call per block
