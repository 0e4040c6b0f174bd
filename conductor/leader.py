"""Who decides: one conductor leads (Schedule, ScheduleBatch, Complete), the others stand by.

``Leadership`` is the embedded mode's: a lone conductor always leads. ``EtcdLeadership`` runs
etcd's election (``v3election``) under ``<prefix>/conductor/leader`` with a lease of ``ttl_s``:

- a conductor campaigns only once its index is warm (membership listed, every node's first
  snapshot loaded, or ``warm_timeout_s`` passed), so a standby that takes over decides with the
  same hit rate as the leader it replaces;
- a leader killed with SIGKILL stops renewing its lease; etcd deletes its candidate key when the
  TTL lapses and the oldest standby's pending Campaign returns: failover within the TTL. A leader
  that stops cleanly revokes its lease: the standby leads at once;
- a leader that learns its lease is gone (it was cut off from etcd longer than the TTL, or etcd
  lost its data) steps down at once and campaigns again;
- while etcd is out of reach the leader keeps leading (and the standbys standing by): routing
  goes on with what everyone knows. The price: a leader cut off from a still-running etcd leads
  until it hears back, beside the standby elected meanwhile. Two schedulers for a while place
  requests with separate ledgers; no cached data is at stake (the nodes own it).

``leading`` is a plain attribute: the Schedule path reads it per call at no cost.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from kvstore.errors import KVStoreError
from plumbing.etcd import EtcdClient, EtcdError, EtcdUnavailable
from plumbing.registration import ConductorRecord

log = logging.getLogger(__name__)

LEADER_HINT_TTL_S = 0.5  # how long a follower trusts the leader address it looked up


class Leadership:
    """A conductor alone: it always leads."""

    name = ""  # the election, for messages
    leading = True
    took_lead_at = -float("inf")  # monotonic time it became leader (embedded: never took over)

    def leader_hint(self) -> str:
        """The leader's address for redirects ("" when unknown)."""
        return ""

    def start(
        self,
        record: ConductorRecord,
        warm: Callable[[float], None] = lambda timeout_s: None,
        on_change: Callable[[bool], None] = lambda leading: None,
    ) -> "Leadership":
        return self

    def stop(self) -> None:
        pass


class EtcdLeadership(Leadership):
    def __init__(
        self,
        etcd: EtcdClient,
        name: str,
        ttl_s: int,
        warm_timeout_s: float = 30.0,
    ) -> None:
        self.etcd, self.name, self.ttl_s = etcd, name, int(ttl_s)
        self.record = ConductorRecord(address="", conductor_id="")  # set by start()
        self.leading = False
        self.took_lead_at = -float("inf")
        self.elections_won = 0
        self._warm_timeout_s = warm_timeout_s
        self._warm: Callable[[float], None] = lambda timeout_s: None
        self._on_change: Callable[[bool], None] = lambda leading: None
        self._lease = 0
        self._lease_changed = threading.Condition()
        self._stop = threading.Event()
        self._hint: tuple[float, str] = (0.0, "")
        self._hint_lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._keep_lease, daemon=True, name="election-lease"),
            threading.Thread(target=self._campaign, daemon=True, name="election-campaign"),
        ]

    def start(
        self,
        record: ConductorRecord,
        warm: Callable[[float], None] = lambda timeout_s: None,
        on_change: Callable[[bool], None] = lambda leading: None,
    ) -> "EtcdLeadership":
        """Campaign as ``record`` (where clients reach this conductor) once ``warm(timeout)``
        returns; ``on_change(leading)`` on every change of role."""
        self.record, self._warm, self._on_change = record, warm, on_change
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        """Stop campaigning; a leader hands over at once (its lease revoked: its key goes)."""
        self._stop.set()
        with self._lease_changed:
            self._lease_changed.notify_all()
        self._threads[0].join(self.etcd.timeout_s * 2 + 1)
        lease, self._lease = self._lease, 0
        self._set_leading(False, "stopping")
        if lease:
            try:
                self.etcd.revoke(lease)
            except (EtcdUnavailable, EtcdError) as e:
                log.info("etcd: could not revoke the election lease (%s); it lapses", e)

    def leader_hint(self) -> str:
        if self.leading:
            return self.record.address
        now = time.monotonic()
        with self._hint_lock:
            at, address = self._hint
            if now - at < LEADER_HINT_TTL_S:
                return address
            try:
                kv = self.etcd.leader(self.name)
                address = ConductorRecord.decode(kv.value).address if kv else ""
            except (EtcdUnavailable, EtcdError, KVStoreError) as e:
                log.debug("leader lookup failed: %s", e)
            self._hint = (now, address)
            return address

    # ---- threads ----------------------------------------------------------------------------

    def _set_lease(self, lease: int) -> None:
        with self._lease_changed:
            self._lease = lease
            self._lease_changed.notify_all()

    def _set_leading(self, leading: bool, why: str) -> None:
        if leading == self.leading:
            return
        self.leading = leading
        if leading:
            self.took_lead_at = time.monotonic()
            self.elections_won += 1
            log.warning("conductor %s leads (%s, election %s)", self.record.address, why, self.name)
        else:
            log.warning("conductor %s stands by (%s)", self.record.address, why)
        try:
            self._on_change(leading)
        except Exception:  # a broken observer must not stop the election
            log.exception("leadership observer failed")

    def _keep_lease(self) -> None:
        """Grant the election lease and renew it every ttl/3; a lease etcd lost ends the lead."""
        failing = False
        while not self._stop.is_set():
            try:
                if not self._lease:
                    self._set_lease(self.etcd.grant(self.ttl_s))
                elif self.etcd.keepalive(self._lease) == 0:
                    self._set_leading(False, "its etcd lease lapsed")
                    self._set_lease(0)
                    continue
                if failing:
                    log.info("etcd reachable again: election lease renewed")
                failing, wait = False, self.ttl_s / 3
            except (EtcdUnavailable, EtcdError) as e:
                if not failing:
                    log.warning(
                        "etcd unreachable (%s): the conductor %s as it was; retrying",
                        e,
                        "leads" if self.leading else "stands by",
                    )
                failing, wait = True, min(self.ttl_s / 3, 0.5)
            self._stop.wait(wait)

    def _campaign(self) -> None:
        """Campaign with the current lease; once elected, hold until that lease changes."""
        self._warm(self._warm_timeout_s)
        value = self.record.encode()
        failing = False
        while not self._stop.is_set():
            with self._lease_changed:
                while not self._lease and not self._stop.is_set():
                    self._lease_changed.wait(1.0)
                lease = self._lease
            if self._stop.is_set():
                return
            try:
                self.etcd.campaign(self.name, lease, value)
            except EtcdUnavailable as e:  # etcd away, or the campaign's read timed out
                if not failing and "timed out" not in str(e).lower():
                    log.warning("etcd: campaign interrupted (%s); campaigning again", e)
                failing = True
                self._stop.wait(0.2)
                continue
            except EtcdError as e:  # e.g. the lease lapsed under the campaign
                log.warning("etcd: campaign refused (%s); campaigning again", e)
                self._stop.wait(0.5)
                continue
            failing = False
            with self._lease_changed:
                if self._lease != lease or self._stop.is_set():
                    continue  # elected on a lease already gone: not leading
                self._set_leading(True, f"elected with lease {lease:x}")
                while self._lease == lease and not self._stop.is_set():
                    self._lease_changed.wait(1.0)
