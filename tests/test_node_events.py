"""The node's event hub: one sequence to the conductor that never hides an event a store lost."""

from __future__ import annotations

from node.events import EventHub

from kvstore_helpers import LAYOUT, keys, make_store, page


def hub_over(**config):
    hub = EventHub()
    store = make_store(layout=LAYOUT, dram_pages=64, on_event=hub.notify, **config)
    hub.attach([store])
    return hub, store


def test_an_event_the_store_dropped_forces_subscribers_to_resync():
    hub, store = hub_over(max_events=4)
    try:
        store.put(keys(1, 2), [page(1), page(2)])
        hub.pump()
        before = hub.read_after(0)
        assert before is not None and len(before) == 2
        cursor = before[-1].seq
        # The pump is late (held off here): the store's 4-event log overflows, dropping 6.
        with hub._cond:
            store.put(keys(*range(10, 20)), [page(i) for i in range(10, 20)])
        hub.pump()
        assert hub.read_after(cursor) is None, "a lost event must not be hidden"
        seq, items = hub.snapshot()
        assert len(items) == 12 and seq >= hub.lost_through
        assert hub.read_after(seq) == []  # resynced: the feed goes on from the snapshot
        store.put(keys(30), [page(30)])
        hub.pump()
        (ev,) = hub.read_after(seq)
        assert ev.seq == seq + 1
    finally:
        hub.close()


def test_no_drop_no_resync():
    hub, store = hub_over(max_events=64)
    try:
        store.put(keys(*range(10)), [page(i) for i in range(10)])
        hub.pump()
        events = hub.read_after(0)
        assert events is not None and [e.seq for e in events] == list(range(1, 11))
        assert hub.lost_through == 0
    finally:
        hub.close()
