"""Random operation sequences against the prefix store: budgets and pins hold after every step.

The machine drives one store (with a disk tier and tiny budgets, so that every step moves
entries between tiers) through puts, lookups of current / longer / changed histories, leases,
releases, clock jumps, flushes and restarts. After each step it checks:

- bytes per tier never exceed the tier's budget, and reservations never exceed the device budget;
- unpinned device bytes fit beside the reservations;
- every leased entry that was placed on the device is still there, and a leased entry in host
  memory is never pushed out of memory;
- whatever a lookup returns matches the history and equals, tensor for tensor, what was stored.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from store_probe import is_leased, keys_by_tier

from relaygr.workers.prefix_kv import Events, PrefixKV, history_fingerprint
from relaygr.workers.store.prefix_store import PrefixStore, PrefixStoreConfig

MV = "m1"
USERS = st.integers(0, 5)
PER_TOKEN = 2 * 2 * 2 * 4 * 4 + 16  # layers * (k, v) * heads * head_dim * float32 + position + timestamp


def _history(user: int, salt: int, n: int) -> Events:
    return Events.from_lists(
        [user * 100_003 + salt * 7919 + i for i in range(n)], [float(60 * i) for i in range(n)]
    )


def _prefix(h: Events, n: int, seed: int) -> PrefixKV:
    g = torch.Generator().manual_seed(seed)
    return PrefixKV(
        keys=[torch.randn(2, n, 4, generator=g) for _ in range(2)],
        values=[torch.randn(2, n, 4, generator=g) for _ in range(2)],
        positions=torch.arange(n),
        timestamps=h.timestamps[:n].clone(),
        length=n,
        fingerprint=history_fingerprint(h, n),
        model_version=MV,
    )


class StoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.dir = tempfile.mkdtemp(prefix="prefix-store-")
        self.t = 0.0
        self.cfg = PrefixStoreConfig(
            device_budget_bytes=30 * PER_TOKEN,
            page_tokens=1,  # a device entry takes its tokens' bytes: 31 tokens fit here
            host_budget_bytes=25 * PER_TOKEN,
            disk_path=self.dir,
            disk_budget_bytes=60 * PER_TOKEN,
            disk_backlog_bytes=40 * PER_TOKEN,
        )
        self.store = self._open()
        self.salt: dict[int, int] = {}  # user -> current history version
        self.stored: dict[tuple[int, bytes], PrefixKV] = {}  # (length, fingerprint) -> what was put
        self.expiry: dict[int, float] = {}  # leases the model believes in
        self.pinned: set[int] = set()  # leased users whose entry was placed on the device
        self.held: set[int] = set()  # leased users whose entry was in memory (device or host)
        self.seed = 0

    def _open(self) -> PrefixStore:
        return PrefixStore(self.cfg, MV, clock=lambda: self.t)

    def _hist(self, user: int, n: int) -> Events:
        return _history(user, self.salt.get(user, 0), n)

    def _drop_expired(self) -> None:
        for u in [u for u, e in self.expiry.items() if e <= self.t]:
            del self.expiry[u]
            self.pinned.discard(u)
            self.held.discard(u)

    def _note_held(self) -> None:
        for u in self.expiry:
            if self.store.where(u) in ("device", "host"):
                self.held.add(u)

    @rule(user=USERS, n=st.integers(1, 14))
    def put(self, user: int, n: int) -> None:
        self.seed += 1
        h = self._hist(user, n)
        # one history prefix, one tensor content: a stale disk copy of it is still "what was stored"
        p = _prefix(h, n, seed=(user * 1000 + self.salt.get(user, 0)) * 100 + n)
        self.stored[(n, p.fingerprint)] = p
        revocations = self.store.metrics()["lease_revocations"]
        tier = self.store.put(user, p)
        self._drop_expired()
        self.pinned.discard(user)
        self.held.discard(user)
        if user in self.expiry:
            if self.store.metrics()["lease_revocations"] > revocations:
                del self.expiry[user]
            else:
                assert tier == "device", "a leased prefix within its reservation goes to the device"
                self.pinned.add(user)

    @rule(user=USERS, n=st.integers(1, 16), change=st.booleans())
    def lookup(self, user: int, n: int, change: bool) -> None:
        if change:
            self.salt[user] = self.salt.get(user, 0) + 1
        h = self._hist(user, n)
        got = self.loop.run_until_complete(self.store.lookup(user, h))
        self._drop_expired()
        if got.invalidated:
            self.pinned.discard(user)
            self.held.discard(user)
        if got.prefix is not None:
            assert got.prefix.matches(h)
            want = self.stored[(got.prefix.length, got.prefix.fingerprint)]
            dense = got.prefix.dense()  # a device hit is paged: its tokens, gathered
            for a, b in zip([*dense.keys, *dense.values], [*want.keys, *want.values], strict=True):
                assert torch.equal(a, b)
            if user in self.expiry and self.store.where(user) == "device":
                self.pinned.add(user)

    @rule(user=USERS, expected=st.integers(0, 16), ttl=st.floats(1, 20))
    def lease(self, user: int, expected: int, ttl: float) -> None:
        r = self.store.lease(user, ttl_s=ttl, expected_bytes=expected * PER_TOKEN)
        self._drop_expired()
        if r.admitted:
            self.expiry[user] = self.t + ttl
            if self.store.where(user) == "device":
                self.pinned.add(user)
        else:
            assert r.reason == "pinned_budget_exceeded"
            assert r.pinned_bytes + r.reserved_bytes > r.budget_bytes or user in self.expiry

    @precondition(lambda self: keys_by_tier(self.store)["host"])
    @rule(data=st.data(), ttl=st.floats(1, 20))
    def lease_host_entry(self, data: st.DataObject, ttl: float) -> None:
        """Lease a user whose entry sits in host memory (not promoted until its next lookup)."""
        user = data.draw(st.sampled_from(sorted(k[0] for k in keys_by_tier(self.store)["host"])))
        self.lease(user, 0, ttl)

    @rule(user=USERS)
    def release(self, user: int) -> None:
        self._drop_expired()
        assert self.store.release(user) == (user in self.expiry)
        self.expiry.pop(user, None)
        self.pinned.discard(user)
        self.held.discard(user)

    @rule(dt=st.floats(0.5, 15))
    def tick(self, dt: float) -> None:
        self.t += dt
        self._drop_expired()

    @rule()
    def flush(self) -> None:
        self.store.flush()

    @precondition(lambda self: self.seed > 0)
    @rule()
    def restart(self) -> None:
        self.store.close()
        self.store = self._open()
        self.expiry.clear()
        self.pinned.clear()
        self.held.clear()

    @invariant()
    def budgets_hold(self) -> None:
        m = self.store.metrics()
        assert m["bytes_device"] <= self.cfg.device_budget_bytes
        assert m["bytes_host"] <= self.cfg.host_budget_bytes
        assert m["bytes_disk"] <= self.cfg.disk_budget_bytes
        assert m["bytes_reserved"] <= self.cfg.device_budget_bytes
        assert m["bytes_device"] - m["bytes_pinned"] + m["bytes_reserved"] <= self.cfg.device_budget_bytes
        assert m["bytes_pending_disk"] >= 0

    @invariant()
    def pins_hold(self) -> None:
        for user in self.pinned:
            assert self.store.where(user) == "device", f"pinned user {user} left the device"
            assert is_leased(self.store, user)

    @invariant()
    def leased_entries_stay_in_memory(self) -> None:
        for user in self.held:
            assert self.store.where(user) in ("device", "host"), f"leased user {user} left memory"
        self._note_held()

    @invariant()
    def one_memory_tier_per_key(self) -> None:
        state = keys_by_tier(self.store)
        assert not set(state["device"]) & set(state["host"])

    def teardown(self) -> None:
        self.store.close()
        self.loop.close()
        shutil.rmtree(self.dir, ignore_errors=True)


StoreMachine.TestCase.settings = settings(
    max_examples=40,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestStoreMachine = StoreMachine.TestCase
