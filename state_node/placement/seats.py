"""Seats: how many of something (replicas, preferred replicas) each node takes, handed out batch after batch so
that after every batch each node holds the floor or the ceiling of the seats handed out so far."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence


class Seats:
    """Seats per node, handed out in batches: `open(k)` announces a batch of k, then `take` gives single seats
    (refused when a node would pass its share), or `hand_out(k, ...)` / `take_exactly(...)` give a whole
    batch at once. After every complete batch the counts are within one of each other: totals stay
    balanced, batch after batch (store after store, or replica count after replica count)."""

    def __init__(self, members: Sequence[str]) -> None:
        self._members = members
        self._count = dict.fromkeys(members, 0)
        self._handed = 0  # seats in all batches opened so far
        self._floor = 0
        self._extra = 0  # nodes that end the open batches at the ceiling
        self._above = 0  # nodes already above the floor (holding some of the `extra` ceilings)

    @property
    def counts(self) -> Mapping[str, int]:
        """Seats per node so far (read only)."""
        return self._count

    def copy(self) -> Seats:
        other = Seats(self._members)
        other._count = dict(self._count)
        other._handed, other._floor, other._extra, other._above = self._handed, self._floor, self._extra, self._above
        return other

    def open(self, k: int) -> None:
        """A batch of k more seats: from now on a node may take seats up to the new floor, and the ceiling
        while fewer nodes than the remainder are above the floor."""
        self._handed += k
        self._floor, self._extra = divmod(self._handed, len(self._members))
        self._above = sum(1 for c in self._count.values() if c > self._floor)

    def free(self, m: str) -> bool:
        """Whether node m may take one more seat of the open batches."""
        c = self._count[m]
        return c < self._floor or (c == self._floor and self._above < self._extra)

    def take(self, m: str) -> bool:
        """One seat to node m, if it may take one; whether it did."""
        if not self.free(m):
            return False
        if self._count[m] == self._floor:
            self._above += 1
        self._count[m] += 1
        return True

    def take_least_loaded(self) -> str:
        """A seat to the node with the fewest that may take one (ties by name); that node."""
        node = min((m for m in self._members if self.free(m)), key=lambda m: (self._count[m], m))
        self.take(node)
        return node

    def forced(self, k: int) -> list[str]:
        """The nodes that the next `hand_out(k)` must give a seat to (they would fall below the floor)."""
        floor = (self._handed + k) // len(self._members)
        return [m for m in self._members if self._count[m] < floor]

    def options(self, k: int) -> tuple[set[str], set[str]]:
        """For the next k seats: the nodes that must take one, and the nodes that may (including those)."""
        floor, extra = divmod(self._handed + k, len(self._members))
        above = sum(1 for c in self._count.values() if c > floor)
        forced = {m for m in self._members if self._count[m] < floor}
        room = extra - above - sum(1 for m in forced if self._count[m] + 1 > floor)
        allowed = forced | ({m for m in self._members if self._count[m] == floor} if room > 0 else set())
        return forced, allowed

    def take_exactly(self, chosen: set[str]) -> None:
        """A batch of one seat to each of `chosen` (drawn from `options(len(chosen))`)."""
        self.open(len(chosen))
        for m in chosen:
            self._count[m] += 1
        self._above = sum(1 for c in self._count.values() if c > self._floor)

    def hand_out(
        self,
        k: int,
        prefer: Sequence[str],
        rank: Mapping[str, int],
        busy: Mapping[str, int] | None = None,
        zone_of: Mapping[str, str] | None = None,
        zone_need: Mapping[str, int] | None = None,
    ) -> set[str]:
        """A batch of k seats to k distinct nodes (k < number of nodes): those below the new floor, then the
        `prefer`red ones (in `rank` order, highest first) where balance allows, then as many in each zone as
        `zone_need` asks (the zones the store's missing replicas lack: a node that leaves is replaced in its
        own zone), then the ones with the fewest seats, zones taking turns, the least `busy` first."""
        if k == 0:
            return set()
        self.open(k)
        chosen: set[str] = set()

        def free(m: str) -> bool:
            return m not in chosen and self.free(m)

        def take(m: str) -> None:
            self.take(m)
            chosen.add(m)

        for m in self._members:
            if self._count[m] < self._floor:
                take(m)
        for m in sorted(prefer, key=lambda m: (-rank.get(m, 0), m)):
            if len(chosen) < k and free(m):
                take(m)
        if len(chosen) < k:
            turns = taking_turns(self._members, lambda m: self._count[m], busy, zone_of)
            if zone_need and zone_of:
                need = dict(zone_need)
                for m in turns:
                    if len(chosen) >= k:
                        break
                    if need.get(zone_of[m], 0) > 0 and free(m):
                        take(m)
                        need[zone_of[m]] -= 1
            for m in turns:
                if len(chosen) < k and free(m):
                    take(m)
        return chosen


def taking_turns(
    nodes: Sequence[str],
    level: Callable[[str], int],
    busy: Mapping[str, int] | None,
    zone_of: Mapping[str, str] | None,
) -> list[str]:
    """`nodes` by `level`, zones taking turns within a level, then by `busy` and name."""
    busy, zone_of = busy or {}, zone_of or {}
    turn: dict[tuple[int, str], int] = {}
    ordered = []
    for lv, b, m in sorted((level(m), busy.get(m, 0), m) for m in nodes):
        key = (lv, zone_of.get(m, m))
        t = turn.get(key, 0)
        turn[key] = t + 1
        ordered.append((lv, t, b, m))
    ordered.sort()
    return [m for _, _, _, m in ordered]
